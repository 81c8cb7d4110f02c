"""The optimizer pre-step fence, on CPU: the registration every CUDA save with an optimizer relies on."""

from __future__ import annotations

import torch

from ckpt.save import cuda_snapshot


class _FinishedCopy:
    """Stands for a CUDA snapshot whose copy has already completed (the only kind a CPU machine can
    hold): the fence asks it once, then forgets it, without touching a device."""

    device = None
    event = None

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return True


def test_fencing_a_snapshot_registers_the_step_hook_and_the_next_step_runs_it():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    copy = _FinishedCopy()
    cuda_snapshot.fence_optimizers(copy)  # raised AttributeError before: torch.optim deletes its `optimizer` name
    p.grad = torch.ones(4)
    opt.step()
    assert copy.asked == 1  # the hook ran before the step and found the copy done
    opt.step()
    assert copy.asked == 1  # a finished copy is dropped, not asked again
    assert torch.allclose(p.detach(), torch.full((4,), 0.8))


def test_install_step_hook_is_idempotent():
    cuda_snapshot.install_step_hook()
    cuda_snapshot.install_step_hook()
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()  # one hook, nothing pending: the step runs unchanged
    assert p.detach().lt(1).all()
