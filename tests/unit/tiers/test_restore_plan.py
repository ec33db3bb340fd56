"""The restore plan: an intact copy of every file from the surviving nodes, or why not."""

from __future__ import annotations

from dist_ckpt.tiers import FileRecord, LocalRestorePlan, Unrestorable, newest_restorable, plan_local_restore

A = FileRecord(10, 1)
B = FileRecord(20, 2)
EXPECTED = {"a": A, "b": B}


def test_own_node_first_then_peers() -> None:
    plan = plan_local_restore(5, EXPECTED, {"n0": {"a": A}, "n1": {"a": A, "b": B}}, preferred=["n0"])
    assert isinstance(plan, LocalRestorePlan)
    assert dict(plan.source) == {"a": "n0", "b": "n1"}


def test_damaged_copy_is_skipped_for_an_intact_one() -> None:
    plan = plan_local_restore(5, EXPECTED, {"n0": {"a": FileRecord(10, 9), "b": B}, "n1": {"a": A}}, ["n0"])
    assert isinstance(plan, LocalRestorePlan) and plan.source["a"] == "n1"


def test_reason_names_missing_and_damaged_files() -> None:
    out = plan_local_restore(5, EXPECTED, {"n0": {"a": FileRecord(10, 9)}})
    assert isinstance(out, Unrestorable)
    assert "a (damaged on n0)" in out.reason and "b (no copy)" in out.reason and "step 5" in out.reason


def test_newest_restorable_reports_the_skipped_steps() -> None:
    good = plan_local_restore(4, EXPECTED, {"n0": {"a": A, "b": B}})
    bad = plan_local_restore(6, EXPECTED, {})
    plan, skipped = newest_restorable([(4, good), (6, bad)])
    assert plan is good and [s.step for s in skipped] == [6]
    assert newest_restorable([(6, bad)]) == (None, [bad])
