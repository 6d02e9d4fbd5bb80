"""The ranks' progress notes, and the launcher's reading of them after a failure."""

import time

from flame.base import progress


def write_notes(folder, notes: dict[int, tuple[int, float]]) -> str:
    folder.mkdir(exist_ok=True)
    for rank, (step, when) in notes.items():
        (folder / f"rank{rank}").write_text(f"{step:>12} {when:>18.3f}\n")
    return str(folder)


def test_a_rank_that_never_started_the_others_step_is_named(tmp_path):
    now = time.time()
    folder = write_notes(tmp_path, {0: (8, now), 1: (7, now), 2: (8, now)})
    assert progress.laggards(folder, failed=0).startswith("rank 1 never started step 8, which the others had "
                                                          "(last started: step 7): the others waited for it")


def test_a_rank_whose_heartbeat_stopped_inside_the_step_is_named_and_the_failing_rank_is_not(tmp_path):
    now = time.time()
    folder = write_notes(tmp_path, {0: (5, now), 1: (5, now - 30), 2: (5, now)})
    assert progress.laggards(folder, failed=0).startswith("rank 1 stopped answering 30 s before the others ended, "
                                                          "inside step 5")
    assert progress.laggards(folder, failed=1) is None  # the launcher names it already, as the rank that failed


def test_ranks_alike_name_no_one(tmp_path):
    now = time.time()
    assert progress.laggards(write_notes(tmp_path / "a", {0: (5, now), 1: (5, now - 1)})) is None
    assert progress.laggards(str(tmp_path / "none")) is None


def test_a_rank_keeps_its_note_with_a_heartbeat_and_the_launcher_clears_old_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_DIR, str(tmp_path))
    monkeypatch.setattr(progress, "BEAT_S", 0.05)
    notes = progress.StepNotes(3)
    notes.starts(12)
    first = progress.read(str(tmp_path))[3]
    time.sleep(0.3)
    step, beat = progress.read(str(tmp_path))[3]
    assert first[0] == step == 12 and beat > first[1], "the heartbeat thread did not write"
    progress.clear(str(tmp_path))
    time.sleep(0.1)  # the heartbeat writes on into the removed file, not a new one
    assert progress.read(str(tmp_path)) == {}
