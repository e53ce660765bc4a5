"""An evaluation's log line says its seconds and its share of the time since the last one."""

from dflash_trainer.evaluation.hooks import eval_share


def test_the_share_is_of_training_and_evaluation_together() -> None:
    assert eval_share(10.0, 490.0) == "10.0 s, 2.0 % of the 500 s since the last"


def test_without_training_time_only_the_seconds_are_said() -> None:
    assert eval_share(3.25, 0.0) == "3.2 s"
