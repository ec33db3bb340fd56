"""The ``safetensors`` sharded backend (version 1, the default): a few safetensors files per rank."""
