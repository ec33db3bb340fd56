"""Megatron-Core module path ``dist_ckpt.validation``: re-exports `dist_ckpt.engine.checks`.

Code written for ``megatron.core.dist_checkpointing.validation`` imports from here unchanged.
"""

from dist_ckpt.engine.checks.common_state import (
    common_state_fingerprints,
    find_common_state_differences,
    validate_common_state_dict,
)
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling, verify_checkpoint_and_load_strategy
from dist_ckpt.engine.checks.sharding import (
    GlobalMetadata,
    check_sharding_integrity,
    determine_global_metadata,
    find_sharding_problems,
    gather_and_validate_sharding,
    validate_sharding_integrity,
)
from dist_ckpt.engine.checks.strict import (
    StrictHandling,
    adjust_non_strict_load,
    determine_missing_and_unexpected_keys,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)

__all__ = [
    "GlobalMetadata",
    "StrictHandling",
    "adjust_non_strict_load",
    "check_sharding_integrity",
    "common_state_fingerprints",
    "determine_global_metadata",
    "determine_missing_and_unexpected_keys",
    "find_common_state_differences",
    "find_sharding_problems",
    "gather_and_validate_sharding",
    "maybe_report_missing_and_unexpected_keys",
    "parse_strict_flag",
    "validate_common_state_dict",
    "validate_integrity_and_strict_load",
    "validate_sharded_objects_handling",
    "validate_sharding_integrity",
    "verify_checkpoint_and_load_strategy",
]
