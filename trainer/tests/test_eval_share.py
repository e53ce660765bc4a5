"""An evaluation's log line says its seconds and its share of the time since the last one."""

from dflash_trainer.evaluation.hooks import eval_share


def test_the_share_is_of_training_and_evaluation_together() -> None:
    assert eval_share(10.0, 490.0) == "10.0 s, 2.0 % of the 500 s since the last"


def test_without_training_time_only_the_seconds_are_said() -> None:
    assert eval_share(3.25, 0.0) == "3.2 s"


def test_a_process_first_evaluation_says_its_share_includes_one_off_work() -> None:
    # The first evaluation of a process compiles the drafter for evaluation and builds the walk's graphs: its
    # share is not what every evaluation costs, and the line must not read as if it were.
    line = eval_share(35.2, 24.0, first=True)
    assert line.startswith("35.2 s, 59.5 % of the 59 s since training began")
    assert "first evaluation of this process" in line and "once" in line
    assert "first" not in eval_share(35.2, 24.0)


def test_first_rows_takes_the_first_rows_of_the_held_out_batches() -> None:
    import torch

    from dflash_trainer.data.batch import Batch
    from dflash_trainer.evaluation.held_out import first_rows

    def batch(start: int, rows: int) -> Batch:
        ids = torch.arange(start, start + rows)[:, None].repeat(1, 3)
        return Batch(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))

    batches = [batch(0, 2), batch(2, 2), batch(4, 2)]
    assert first_rows(batches, 0) == batches
    kept = first_rows(batches, 3)
    assert [b.input_ids[:, 0].tolist() for b in kept] == [[0, 1], [2]]
    assert all(b.attention_mask.shape == b.input_ids.shape for b in kept)
    assert sum(b.input_ids.shape[0] for b in first_rows(batches, 100)) == 6
