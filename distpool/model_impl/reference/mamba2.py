"""The reference model's Mamba2 mixer, and the recurrent state it keeps per request (shared
numerics and weights: layers.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distpool.model_impl.reference.layers import WeightFactory, rms_norm, round_to, take
from distpool.model_impl.reference.tensor_parallel import TPRank, columns

# Mamba2's dt is drawn log-uniform in this range (the bundled reference configs' time_step_min/max).
TIME_STEP_MIN, TIME_STEP_MAX = 0.01, 0.2


class Mamba2Layer:
    """Mamba2 mixer: in_proj -> [z | xBC | dt], causal depthwise conv over xBC, selective scan,
    gated group RMSNorm, out_proj.

    Per-request state (the convention every pool shares):
      conv (conv_dim, conv_kernel - 1): the last conv_kernel - 1 xBC inputs, oldest first
      ssm  (num_heads, head_dim, state_size)
    with conv_dim = num_heads * head_dim + 2 * n_groups * state_size.

    On a TP rank every size above is the rank's: the heads its `ssm` shard holds and the conv
    channels its `conv` shard holds (x of those heads, then B and C of their groups, a replicated
    group's whole). The gated norm runs per group; a group whose heads span several ranks (fewer
    groups than ranks) has its mean square summed over the group before it is applied.
    """

    def __init__(
        self,
        weights: WeightFactory,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        eps: float,
        time_step_min: float,
        time_step_max: float,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        tp: TPRank,
        state_names: tuple[str, str],  # the conv and SSM state tensors, as the shard names them
    ) -> None:
        if num_heads % n_groups:
            raise ValueError(f"{num_heads} Mamba heads do not divide into {n_groups} groups")
        full_intermediate = num_heads * head_dim
        full_conv_dim = full_intermediate + 2 * n_groups * state_size
        channels, heads = tp.held(state_names[0]), tp.held(state_names[1])  # conv channels, Mamba heads
        self.tp = tp
        self.num_heads, self.head_dim, self.state_size = len(heads), head_dim, state_size
        self.conv_kernel, self.eps = conv_kernel, eps
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.intermediate_size = len(heads) * head_dim
        self.conv_dim = len(channels)
        self.n_groups = (self.conv_dim - self.intermediate_size) // (2 * state_size)
        x_columns = columns(heads, head_dim)
        if not torch.equal(channels[: self.intermediate_size], x_columns):
            raise ValueError(f"rank {tp.shard.rank}'s conv channels do not start with its heads' x columns")
        # the norm's group of this rank's heads when they are only part of it, else None
        heads_per_group = num_heads // n_groups
        self.total_groups, self.group_channels = n_groups, heads_per_group * head_dim
        self.shared_group = int(heads[0]) // heads_per_group if len(heads) < heads_per_group else None
        if self.shared_group is not None:
            b_group = int(channels[self.intermediate_size] - full_intermediate) // state_size
            if self.n_groups != 1 or b_group != self.shared_group:
                raise ValueError(
                    f"rank {tp.shard.rank}'s conv channels hold group {b_group}, "
                    f"its heads group {self.shared_group}"
                )
        in_proj = weights.normal(
            hidden_size, full_intermediate + full_conv_dim + num_heads, std=hidden_size**-0.5
        )
        # [z | xBC | dt] columns of the rank: z like x, xBC its conv channels, dt its heads
        in_columns = torch.cat(
            [x_columns, full_intermediate + channels, full_intermediate + full_conv_dim + heads]
        )
        self.in_proj = take(in_proj, 1, in_columns)
        conv_weight = weights.normal(full_conv_dim, conv_kernel, std=conv_kernel**-0.5)  # depthwise taps
        self.conv_weight = take(conv_weight, 0, channels)
        self.conv_bias = take(weights.normal(full_conv_dim, std=0.1), 0, channels)
        # dt log-uniform in [min, max] after softplus, as Mamba2 initialises it
        log_dt = weights.uniform(num_heads, low=math.log(time_step_min), high=math.log(time_step_max))
        dt = log_dt.exp()
        self.dt_bias = take(dt + torch.log(-torch.expm1(-dt)), 0, heads)  # inverse softplus
        self.a = take(-weights.uniform(num_heads, low=1.0, high=16.0), 0, heads)  # A = -exp(A_log), per head
        self.d = take(weights.uniform(num_heads, low=0.5, high=1.5), 0, heads)
        out_proj = weights.normal(full_intermediate, hidden_size, std=full_intermediate**-0.5)
        self.out_proj = take(out_proj, 0, x_columns)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def forward_sequence(
        self, x: torch.Tensor, conv_state: torch.Tensor | None = None, ssm_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) of one request from its state before them (conv (conv_dim, kernel - 1), ssm
        (heads, head_dim, state); None: zero state) -> out (T, hidden), final conv state, final ssm
        state. Running a sequence in chunks, each from the state the last one returned, gives the same
        numbers as running it whole."""
        z, xbc, dt = self._project(x)
        if conv_state is None:
            conv_state = torch.zeros(self.conv_dim, self.conv_kernel - 1, dtype=xbc.dtype, device=xbc.device)
        if ssm_state is None:
            ssm_state = torch.zeros(*self.ssm_state_shape, dtype=x.dtype, device=x.device)
        padded = torch.cat([conv_state.T, xbc])  # (T + kernel - 1, conv_dim)
        activated = self._convolve(padded.unfold(0, self.conv_kernel, 1))  # windows (T, conv_dim, kernel)
        y, ssm_state = self._scan(ssm_state[None], activated, dt, sequential=True)
        conv_state = padded[x.shape[0] :].T  # last kernel - 1 inputs (older state ones for short chunks)
        return self._output(y, z), conv_state, ssm_state[0]

    def forward_step(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token for B requests: x (B, hidden), conv (B, conv_dim, kernel - 1),
        ssm (B, heads, head_dim, state) -> out (B, hidden), new conv state, new ssm state."""
        z, xbc, dt = self._project(x)
        windows = torch.cat([conv_state, xbc[:, :, None]], dim=-1)  # (B, conv_dim, kernel)
        y, ssm_state = self._scan(ssm_state, self._convolve(windows), dt, sequential=False)
        return self._output(y, z), windows[:, :, 1:], ssm_state

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z, xbc, dt = (x @ self.in_proj).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        return z, round_to(xbc, self.conv_dtype), F.softplus(dt + self.dt_bias)

    def _convolve(self, windows: torch.Tensor) -> torch.Tensor:
        return F.silu((windows * self.conv_weight).sum(dim=-1) + self.conv_bias)

    def _scan(
        self, ssm_state: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, *, sequential: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selective scan over L rows of activated xbc (L, conv_dim) and dt (L, heads).

        sequential: the rows are L tokens of one request; ssm_state (1, H, P, N) is its state
        before the first. Otherwise the rows are one token of each of L requests and ssm_state
        (L, H, P, N) holds theirs. Returns y (L, H*P) and the state after the last token
        ((1, ...) or (L, ...)). Both modes apply the same elementwise update per token.
        """
        rows = xbc.shape[0]
        group_size = self.n_groups * self.state_size
        x, b, c = xbc.split([self.intermediate_size, group_size, group_size], dim=-1)
        x = x.view(rows, self.num_heads, self.head_dim)
        heads_per_group = self.num_heads // self.n_groups
        b = b.view(rows, self.n_groups, self.state_size).repeat_interleave(heads_per_group, dim=1)
        c = c.view(rows, self.n_groups, self.state_size).repeat_interleave(heads_per_group, dim=1)
        decay = torch.exp(dt * self.a)[:, :, None, None]  # (L, H, 1, 1)
        update = (dt[:, :, None] * x)[:, :, :, None] * b[:, :, None, :]  # (L, H, P, N)
        if sequential:
            states = []
            for t in range(rows):  # the recurrence itself, token by token from the given state
                ssm_state = round_to(ssm_state * decay[t] + update[t], self.ssm_dtype)
                states.append(ssm_state)
            every_state = torch.cat(states)  # (L, H, P, N): the state after each token
        else:
            ssm_state = every_state = round_to(ssm_state * decay + update, self.ssm_dtype)
        y = torch.einsum("lhpn,lhn->lhp", every_state, c) + self.d[:, None] * x
        return y.reshape(rows, self.intermediate_size), ssm_state

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = (y * F.silu(z)).unflatten(-1, (self.n_groups, -1))  # norm per group
        if self.shared_group is None:  # every group of the rank's heads is whole here
            normed = rms_norm(gated, 1.0, self.eps)
        else:
            normed = gated * torch.rsqrt(self._group_mean_square(gated) + self.eps)
        return self.tp.all_reduce(normed.flatten(-2) @ self.out_proj)

    def _group_mean_square(self, gated: torch.Tensor) -> torch.Tensor:
        """gated (..., 1, channels of the rank) -> (..., 1, 1): the mean square over the whole of the
        rank's group, whose other channels live on the ranks holding that group's other heads."""
        sums = gated.new_zeros(*gated.shape[:-2], self.total_groups)  # one column per group
        sums[..., self.shared_group] = gated.pow(2).sum(dim=(-2, -1))
        self.tp.all_reduce(sums)  # each rank adds its part of its own group's column
        return (sums[..., self.shared_group] / self.group_channels)[..., None, None]
