"""The layer kinds of the reference hybrid model: GQA attention, Mamba2 and a relu^2 MLP.

Every layer computes in float64 from float32-representable weights. Values a cache stores (K and V,
the conv inputs, the SSM state) are rounded to their cache dtype where they are produced, on the
cached and on the uncached path alike, so both paths see the same numbers and greedy tokens agree.
Layers take and return plain tensors; the model moves them in and out of pages and slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distpool.model.dtypes import torch_dtype
from distpool.model.spec import ModelSpec

COMPUTE_DTYPE = torch.float64
# Mamba2's dt is drawn log-uniform in this range (the bundled reference configs' time_step_min/max).
TIME_STEP_MIN, TIME_STEP_MAX = 0.01, 0.2


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as it reads back after a round trip through a cache of `dtype` (still in x's dtype)."""
    return x.to(dtype).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    """Every norm weight of the reference model is 1.0 (its initial value), so callers pass 1.0."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class WeightFactory:
    """Draws weights from one seeded generator, in a fixed order.

    Draws happen in float32 on the CPU so every device gets the same numbers; the results are
    handed out as float64 on the target device.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.device = device

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(COMPUTE_DTYPE).to(self.device)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return self._out(torch.randn(shape, generator=self.generator) * std)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return self._out(torch.rand(shape, generator=self.generator) * (high - low) + low)


class AttentionLayer:
    """Grouped-query attention without positional encoding (Nemotron-H attention is NoPE)."""

    def __init__(
        self,
        weights: WeightFactory,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype,
    ) -> None:
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        # (in, out) so that a projection is `x @ w`
        self.q_proj = weights.normal(hidden_size, num_heads * head_dim, std=hidden_size**-0.5)
        self.k_proj = weights.normal(hidden_size, num_kv_heads * head_dim, std=hidden_size**-0.5)
        self.v_proj = weights.normal(hidden_size, num_kv_heads * head_dim, std=hidden_size**-0.5)
        self.o_proj = weights.normal(num_heads * head_dim, hidden_size, std=(num_heads * head_dim) ** -0.5)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., hidden) -> q (..., heads, head_dim); k, v (..., kv_heads, head_dim), rounded to the
        KV cache dtype."""
        lead = x.shape[:-1]
        q = (x @ self.q_proj).view(*lead, self.num_heads, self.head_dim)
        k = (x @ self.k_proj).view(*lead, self.num_kv_heads, self.head_dim)
        v = (x @ self.v_proj).view(*lead, self.num_kv_heads, self.head_dim)
        return q, round_to(k, self.kv_dtype), round_to(v, self.kv_dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q (B, Tq, heads, d); k, v (B, S, kv_heads, d); valid (B, Tq, S) bool -> (B, Tq, hidden).

        Keys no query may see are zeroed first: gathered pages hold whatever bytes were there before
        (possibly NaN), and 0 * NaN would leak through the softmax weights.
        """
        seen = valid.any(dim=1)[:, :, None, None]  # (B, S, 1, 1)
        k = torch.where(seen, k, 0.0).repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        v = torch.where(seen, v, 0.0).repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        scores = torch.einsum("bqhd,bshd->bhqs", q, k) * self.head_dim**-0.5
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        out = torch.einsum("bhqs,bshd->bqhd", scores.softmax(dim=-1), v)
        return out.reshape(*out.shape[:2], -1) @ self.o_proj


class Mamba2Layer:
    """Mamba2 mixer: in_proj -> [z | xBC | dt], causal depthwise conv over xBC, selective scan,
    gated group RMSNorm, out_proj.

    Per-request state (the convention every pool shares):
      conv (conv_dim, conv_kernel - 1): the last conv_kernel - 1 xBC inputs, oldest first
      ssm  (num_heads, head_dim, state_size)
    with conv_dim = num_heads * head_dim + 2 * n_groups * state_size.
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
    ) -> None:
        assert num_heads % n_groups == 0, (num_heads, n_groups)
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.conv_kernel, self.eps = n_groups, conv_kernel, eps
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.in_proj = weights.normal(
            hidden_size, self.intermediate_size + self.conv_dim + num_heads, std=hidden_size**-0.5
        )
        self.conv_weight = weights.normal(self.conv_dim, conv_kernel, std=conv_kernel**-0.5)  # depthwise taps
        self.conv_bias = weights.normal(self.conv_dim, std=0.1)
        # dt log-uniform in [min, max] after softplus, as Mamba2 initialises it
        log_dt = weights.uniform(num_heads, low=math.log(time_step_min), high=math.log(time_step_max))
        dt = log_dt.exp()
        self.dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        self.a = -weights.uniform(num_heads, low=1.0, high=16.0)  # A = -exp(A_log), per head
        self.d = weights.uniform(num_heads, low=0.5, high=1.5)
        self.out_proj = weights.normal(self.intermediate_size, hidden_size, std=self.intermediate_size**-0.5)

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
        return rms_norm(gated, 1.0, self.eps).flatten(-2) @ self.out_proj


class MlpLayer:
    """Nemotron-H MLP: down(relu(up(x)) ** 2)."""

    def __init__(self, weights: WeightFactory, *, hidden_size: int, intermediate_size: int) -> None:
        self.up_proj = weights.normal(hidden_size, intermediate_size, std=hidden_size**-0.5)
        self.down_proj = weights.normal(intermediate_size, hidden_size, std=intermediate_size**-0.5)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x @ self.up_proj).square() @ self.down_proj


Layer = AttentionLayer | Mamba2Layer | MlpLayer


def build_layers(spec: ModelSpec, weights: WeightFactory) -> list[Layer]:
    """One layer per model layer, in order: attention for the spec's full-attention layers, Mamba2
    for its Mamba layers, an MLP for every other layer. Cache shapes come from the spec itself."""
    attention, mamba = spec.full_attention, spec.mamba
    assert attention is not None and mamba is not None
    conv, ssm = (t for t in mamba.tensors)  # conv (conv_dim, kernel - 1), ssm (heads, head_dim, state)
    heads, head_dim, state_size = ssm.shape
    n_groups = (conv.shape[0] - heads * head_dim) // (2 * state_size)
    layers: list[Layer] = []
    for index in range(spec.num_layers):
        if index in spec.full_attention_layers:
            layer: Layer = AttentionLayer(
                weights,
                hidden_size=spec.hidden_size,
                num_heads=spec.num_attention_heads,
                num_kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim,
                kv_dtype=torch_dtype(attention.dtype),
            )
        elif index in spec.mamba_layers:
            layer = Mamba2Layer(
                weights,
                hidden_size=spec.hidden_size,
                num_heads=heads,
                head_dim=head_dim,
                state_size=state_size,
                n_groups=n_groups,
                conv_kernel=conv.shape[1] + 1,
                eps=spec.norm_eps,
                time_step_min=TIME_STEP_MIN,
                time_step_max=TIME_STEP_MAX,
                conv_dtype=torch_dtype(conv.dtype),
                ssm_dtype=torch_dtype(ssm.dtype),
            )
        else:
            layer = MlpLayer(weights, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size)
        layers.append(layer)
    return layers
