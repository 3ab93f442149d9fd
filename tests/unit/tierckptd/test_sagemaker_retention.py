"""A namespace's `steps_retained` window (`tierckptd.sagemaker.retention`): which
committed steps fall out of it, by commit order, and what is never removed."""

from __future__ import annotations

from tierckptd.model import CheckpointView, State
from tierckptd.sagemaker.retention import window_evictions


def _view(step: int, state: State = State.COMMITTED, *, pinned: bool = False) -> CheckpointView:
    return CheckpointView(
        namespace="ns",
        checkpoint_id=f"step_{step}",
        state=state,
        size_bytes=0,
        created_unix=0.0,
        committed_unix=0.0,
        sequence=step,
        pinned=pinned,
        files=(),
        local_paths={},
    )


def test_window_keeps_the_newest_by_commit_order_not_by_step_number() -> None:
    steps = [_view(s) for s in (1, 2, 3, 4, 5)]
    assert window_evictions(steps, 2) == ["step_3", "step_2", "step_1"]
    # A job restarted at step 1 commits it after step 5: it is the newest and stays.
    restarted = [_view(s) for s in (3, 4, 5)] + [_view(1)]
    assert window_evictions(restarted, 2) == ["step_4", "step_3"]
    assert window_evictions(steps, 0) == []  # 0: no window (never sent: >= 1 is enforced)


def test_window_never_removes_pinned_durable_due_or_the_newest() -> None:
    steps = [
        _view(1, pinned=True),
        _view(2, State.DURABLE),
        _view(3),  # due for the persistent tier, not durable yet
        _view(4),
        _view(5),
    ]
    assert window_evictions(steps, 1, held={"step_3"}) == ["step_4"]
    # A LOST newest step never takes a complete one's place: the newest complete stays.
    lost_newest = [_view(1), _view(2), _view(3, State.LOST)]
    assert window_evictions(lost_newest, 1) == ["step_1"]
