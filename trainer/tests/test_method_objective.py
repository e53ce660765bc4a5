import torch
from torch import nn

from dflash_trainer.method.objective import ObjectiveConfig, dflash_loss
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target import TargetBatch


def _batch(seed: int) -> TargetBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (2, 32), generator=gen)
    loss_mask = torch.zeros(2, 32, dtype=torch.bool)
    loss_mask[:, 8:] = True
    return TargetBatch(input_ids=ids, loss_mask=loss_mask, context=torch.randn(2, 32, 128, generator=gen))


def test_objective_trains_only_the_drafter(small_spec) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec)
    embed = nn.Embedding(512, 64).requires_grad_(False)
    head = nn.Linear(64, 512, bias=False).requires_grad_(False)
    cfg = ObjectiveConfig(block_size=4, mask_token_id=511, max_anchors=6, gamma=4.0, loss_chunk_size=16)
    out = dflash_loss(drafter, _batch(0), embed, head, cfg, torch.Generator().manual_seed(0))
    assert torch.isfinite(out.loss) and out.num_tokens > 0
    assert out.per_position_acc.shape == (3,)
    assert 1.0 <= out.anchor_accept <= 4.0
    out.loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert embed.weight.grad is None and head.weight.grad is None


def test_objective_loss_decreases_when_overfitting(small_spec) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec)
    embed = nn.Embedding(512, 64).requires_grad_(False)
    head = nn.Linear(64, 512, bias=False).requires_grad_(False)
    cfg = ObjectiveConfig(block_size=4, mask_token_id=511, max_anchors=4, gamma=4.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    batch = _batch(1)
    losses = []
    for step in range(15):
        out = dflash_loss(drafter, batch, embed, head, cfg, torch.Generator().manual_seed(step % 2))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0]
