import pytest

from dflash_trainer.method.layers import target_layer_ids


def test_reference_target_layers() -> None:
    assert target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_one_layer_is_the_middle() -> None:
    assert target_layer_ids(64, 1) == [32]
    assert target_layer_ids(8, 1) == [4]


def test_spans_one_to_l_minus_three() -> None:
    ids = target_layer_ids(36, 4)
    assert ids[0] == 1 and ids[-1] == 33
    assert ids == sorted(set(ids))


def test_matches_dflash_helper() -> None:
    dflash_model = pytest.importorskip("dflash.model")
    for num_target in (8, 28, 36, 48, 64):
        for num_draft in (1, 2, 3, 5, 8):
            assert target_layer_ids(num_target, num_draft) == dflash_model.build_target_layer_ids(
                num_target, num_draft
            )


def test_rejects_impossible() -> None:
    with pytest.raises(ValueError):
        target_layer_ids(4, 3)
    with pytest.raises(ValueError):
        target_layer_ids(64, 0)
