"""BatchNorm statistics over the global batch, on any process-group backend.

torch's `nn.SyncBatchNorm` raises on CPU tensors ("SyncBatchNorm expected input tensor to
be on GPU ..."), so gloo users have no synchronized BatchNorm. `sync_batchnorm(model)`
gives them one; under NCCL it leaves the work to torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "sync_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """The sum over ranks; its gradient is again the sum over ranks of the gradients.

    What `torch.distributed.nn.functional.all_reduce` does, written here because torch
    2.13 deprecated that one (a FutureWarning in the cell's output) and the functional
    collectives that replace it are private and not differentiable in older torch.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)  # looked up at call time: the worker's hang marks see it
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # Every rank's loss depends on the summed value: the gradient of each rank's
        # input is the sum of all ranks' gradients of that value.
        return _AllReduceSum.apply(grad)


def _group_size() -> int:
    # The world group at call time, never one stored in the module: jupyter_scale forms
    # the group anew after a failed cell, and a stored group would be a dead one.
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank's samples (any backend).

    Outside a process group of more than one rank, and in eval mode, it is the
    `_BatchNorm` forward itself, so the same cell run locally computes the same thing.
    Accepts channels-first input of any rank >= 2 (N, C, ...), as torch's SyncBatchNorm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or _group_size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0
        if self.track_running_stats:
            assert self.num_batches_tracked is not None  # _NormBase has the running buffers when it tracks
            self.num_batches_tracked.add_(1)  # as _BatchNorm: before the statistics
            factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum

        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        # Sums, not means: ranks may hold different numbers of samples (even none, and an
        # empty rank must still join the collective), so only the global count divides.
        # Accumulated in float64 so that E[x^2] - E[x]^2 keeps its digits when |mean| >> std.
        wide = input.to(torch.promote_types(input.dtype, torch.float32))
        local = torch.cat([wide.sum(dims, dtype=torch.float64),
                           wide.square().sum(dims, dtype=torch.float64),
                           torch.tensor([input.numel() // channels], dtype=torch.float64, device=input.device)])
        # One collective per forward; differentiable, so backward sums every rank's
        # gradient of the statistics (what torch's SyncBatchNorm all-reduces as sum_dy
        # and sum_dy_xmu) before each rank forms its own input's gradient.
        total = _AllReduceSum.apply(local)
        count = int(total[-1].item())
        if count < 2:  # the same count on every rank: they all raise, none hangs
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} over all ranks")
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean.square()).clamp_min(0)  # biased, to normalize

        # Centered before scaling: the weight's gradient is then a sum of dy * (x - mean),
        # not of dy * x, which loses digits when |mean| >> std (torch's backward centers too).
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shape = (1, channels) + (1,) * (input.dim() - 2)
        out = (input - mean.to(input.dtype).view(shape)) * scale.to(input.dtype).view(shape)
        if self.bias is not None:
            out = out + self.bias.to(input.dtype).view(shape)

        if self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None  # tracked: see above
            with torch.no_grad():  # running_var is unbiased over the global count, as BatchNorm's
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = var * (count / (count - 1))
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out


_CONVERTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def sync_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with every BatchNorm1d/2d/3d (and torch's SyncBatchNorm) synchronized.

    Like `nn.SyncBatchNorm.convert_sync_batchnorm`: submodules are replaced in place and
    `module` is returned (a new module if `module` itself is a BatchNorm). The new layers
    hold the very same parameters and buffers (an optimizer built over the model still
    drives them), the same training flag, and the same state_dict keys, so weights load
    into the unconverted model and back. Under an NCCL group torch's own SyncBatchNorm is
    used; elsewhere (gloo, CPU, or no group at all) this module's.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert(module)


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, _CONVERTED):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        if module.track_running_stats:
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert(child))
    return module
