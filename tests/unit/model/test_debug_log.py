"""Scoped debug logging (Megatron-Core's utils.logger_stack, debug_time, debug_msg)."""

import logging
import threading

import pytest

from dist_ckpt.model.debug_log import debug_msg, debug_time, fallback_logger, logger_stack


def test_logger_stack_joins_names_and_restores_them() -> None:
    custom = logging.getLogger("test.debug_log.custom")
    with logger_stack("save", custom) as (name, log):
        assert (name, log) == ("save", custom)
        with logger_stack("sharded") as (inner, inner_log):
            assert (inner, inner_log) == ("save.sharded", custom)
        with logger_stack() as (same, _):
            assert same == "save"
    with logger_stack() as (empty, log):
        assert (empty, log) == ("", fallback_logger)


def test_logger_stack_pops_on_error() -> None:
    with pytest.raises(RuntimeError):
        with logger_stack("failing"):
            raise RuntimeError("boom")
    with logger_stack() as (name, _):
        assert name == ""


def test_logger_stack_is_per_thread() -> None:
    seen = []
    with logger_stack("main"):
        thread = threading.Thread(target=lambda: seen.append(logger_stack().__enter__()[0]))
        thread.start()
        thread.join()
    assert seen == [""]


def test_debug_time_logs_the_stacked_name_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.debug_log.time")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with debug_time("outer", log):
            with debug_time("inner"):
                pass
    messages = [(r.levelno, r.getMessage().rsplit(" ", 1)[0]) for r in caplog.records]
    assert messages == [(logging.DEBUG, "outer.inner took"), (logging.DEBUG, "outer took")]


def test_debug_time_threshold_skips_fast_blocks_and_warns_slow_ones(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.debug_log.threshold")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with debug_time("never_this_slow", log, threshold=1e9):
            pass
        with debug_time("always_slow_enough", log, threshold=0.0):
            pass
        with debug_time("explicit_level", log, threshold=0.0, level=logging.INFO):
            pass
    assert [(r.levelno, r.getMessage().split()[0]) for r in caplog.records] == [
        (logging.WARNING, "always_slow_enough"),
        (logging.INFO, "explicit_level"),
    ]


def test_debug_time_decorates_a_function(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.debug_log.decorator")

    @debug_time("work", log)
    def work(x: int) -> int:
        return x + 1

    with caplog.at_level(logging.DEBUG, logger=log.name):
        assert work(1) == 2
        assert work(2) == 3
    assert [r.getMessage().split()[0] for r in caplog.records] == ["work", "work"]


def test_debug_msg_prefixes_the_stack(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.debug_log.msg")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with logger_stack("load", log):
            debug_msg("opened")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "load opened")]
