"""What a launch that timed out says about each stuck rank (hypershard.launch.ranks._stuck_report):
a rank that never reached its entry point is still starting, not stuck in a destructor."""

from hypershard.launch.ranks import _stuck_report


def test_a_rank_without_a_phase_is_still_starting(tmp_path):
    report = _stuck_report(str(tmp_path), [0])
    assert "rank 0: not started (still importing the target's module)" in report
    assert "destructor" not in report


def test_a_running_rank_without_a_stack_is_outside_python(tmp_path):
    (tmp_path / "rank1.phase").write_text("running")
    report = _stuck_report(str(tmp_path), [1])
    assert "rank 1: running" in report and "stuck outside Python" in report


def test_a_dumped_stack_is_shown(tmp_path):
    (tmp_path / "rank0.phase").write_text("running")
    (tmp_path / "rank0.stacks").write_text('Current thread 0x1 (most recent call first):\n  File "x.py", line 3 in f\n')
    report = _stuck_report(str(tmp_path), [0])
    assert 'File "x.py", line 3 in f' in report and "stuck outside Python" not in report
