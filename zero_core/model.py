"""The tiny GPT every stage trains, and the data it trains on.

A character-level, nanoGPT-shaped transformer: token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a final LayerNorm and an untied LM head. Every parameter lives in
an `nn.Linear`, `nn.Embedding` or `nn.LayerNorm` (with affine weights), so a ZeRO stage can take over a
layer's parameters by swapping that module, and nothing else in the model needs to know.

Initialisation and data never touch torch's global RNG: rank threads share it, so both take explicit
generators, and every rank and every stage starts from the same weights and sees the same batches.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import MappingProxyType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from zero_core.partition import flatten

DATA_FILE = "sonnets.txt"


@cache
def corpus() -> tuple[torch.Tensor, str]:
    """The shipped public-domain text as character ids, and its alphabet (ids index into it)."""
    text = resources.files("zero_core.data").joinpath(DATA_FILE).read_text(encoding="utf-8")
    alphabet = "".join(sorted(set(text)))
    ids = torch.tensor([alphabet.index(ch) for ch in text], dtype=torch.long)
    return ids, alphabet


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model and of one rank's micro-batch."""

    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    micro_batch_size: int = 4
    init_std: float = 0.02
    activation_checkpointing: bool = False
    """Keep only each block's input for backward and recompute the block then (ZeRO-R §6.1, Chen et al.)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")


PRESETS: dict[str, GPTConfig] = {
    "micro": GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, micro_batch_size=2),
    "tiny": GPTConfig(),
    "small": GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=384, micro_batch_size=4),
}
"""micro: fast tests (~17K parameters); tiny: the default (~0.62M); small: scaling runs (~10.7M)."""


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, seq, channels)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of `idx` (batch, seq) of character ids."""
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing:
                x = checkpoint(block, x, use_reentrant=True, preserve_rng_state=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy, computed in fp32 whatever the logits' precision."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


PARAMETER_LAYERS = (nn.Linear, nn.Embedding, nn.LayerNorm)


def parameter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters, in a fixed order: the units ZeRO partitions and gathers."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, PARAMETER_LAYERS)]


_TEMPLATES: dict[tuple[GPTConfig, int], GPT] = {}
_TEMPLATES_LOCK = threading.Lock()


def _template(config: GPTConfig, seed: int = 0) -> GPT:
    """The initialised model of (`config`, `seed`), built once per process; `build_model` hands out copies.

    nn.Module constructors initialise their weights from torch's global RNG; `fork_rng` puts it back as it
    was, and the lock keeps rank threads from building (and forking the RNG) at the same time. Building on
    the "meta" device would avoid the RNG but imports torch's compiler stack, seconds on these machines.
    It is built outside the calling rank's dispatch modes: a rank's memory audit sees the rank's own copy
    being made, not the template. Each rank copies the drawn values rather than drawing them again, the
    cheaper of the two on hundreds of virtual GPUs.
    """
    with _TEMPLATES_LOCK:
        if (config, seed) not in _TEMPLATES:
            with torch.random.fork_rng(devices=[]), _disable_current_modes():
                _TEMPLATES[config, seed] = _initialise(GPT(config), config, seed)
        return _TEMPLATES[config, seed]


def _initialise(model: GPT, config: GPTConfig, seed: int) -> GPT:
    """GPT-2 initialisation, drawn from a generator of its own: N(0, init_std) weights, zero biases, unit
    LayerNorm gains. Every parameter is overwritten, so the constructor's draws leave no trace."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in parameter_layers(model):
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            else:
                module.weight.normal_(0.0, config.init_std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
    return model


def build_model(config: GPTConfig, seed: int = 0) -> GPT:
    """A GPT in fp32 with GPT-2 initialisation drawn from its own generator (same on every rank).

    A copy of the process's template for (`config`, `seed`): parameters of its own, with the template's
    values bit for bit."""
    return _copy_module(_template(config, seed))


def model_skeleton(config: GPTConfig, seed: int = 0) -> GPT:
    """A copy of the template for (`config`, `seed`) whose parameters are the template's own tensors.

    For a ZeRO stage, which replaces every parameter by buffers of the rank's own before training
    (`ZeroStage._build` checks that none is left): copying values that are replaced at once would cost
    every virtual GPU a copy of the whole model for nothing. Read its values from `initial_values`."""
    return _copy_module(_template(config, seed), share_parameters=True)


_INITIAL_VALUES: dict[tuple[GPTConfig, int], Mapping[str, torch.Tensor]] = {}


def initial_values(config: GPTConfig, seed: int = 0) -> Mapping[str, torch.Tensor]:
    """Per parameter layer (`parameter_layers` order), its parameters flattened into one fp32 tensor: the
    values every rank starts from, the unit a stage partitions.

    Made once per process, outside the calling rank's dispatch modes, like the template they come from,
    and shared by every caller (the table itself is read-only): read them, copy what you keep, never write
    into them.
    """
    template = _template(config, seed)
    with _TEMPLATES_LOCK:
        if (config, seed) not in _INITIAL_VALUES:
            with _disable_current_modes(), torch.no_grad():
                _INITIAL_VALUES[config, seed] = MappingProxyType(
                    {
                        name: flatten(list(module.parameters()))
                        for name, module in parameter_layers(template)
                    }
                )
        return _INITIAL_VALUES[config, seed]


def _copy_module(module: nn.Module, *, share_parameters: bool = False) -> nn.Module:
    """What `copy.deepcopy` makes of a module of this file, without deepcopy's generic walk over every
    object (every virtual GPU builds one): parameters, buffers and submodules of its own, tables (hooks)
    copied, plain values (the frozen config, ints) shared. With `share_parameters`, the parameters are the
    module's own (`model_skeleton`)."""
    state = {}
    for key, value in module.__dict__.items():
        if isinstance(value, torch.Tensor):
            value = value.clone()
        elif isinstance(value, dict | set | list):
            value = type(value)(value)
        state[key] = value
    state["_parameters"] = (
        dict(module._parameters)
        if share_parameters
        else {
            name: None if p is None else nn.Parameter(p.detach().clone(), p.requires_grad)
            for name, p in module._parameters.items()
        }
    )
    state["_buffers"] = {name: None if b is None else b.clone() for name, b in module._buffers.items()}
    state["_modules"] = {
        name: None if m is None else _copy_module(m, share_parameters=share_parameters)
        for name, m in module._modules.items()
    }
    clone = object.__new__(type(module))
    clone.__dict__.update(state)  # not through nn.Module.__setattr__, which would sort each value again
    return clone


def count_parameters(config: GPTConfig) -> int:
    """Ψ, the number of parameters."""
    return sum(p.numel() for p in _template(config).parameters())


def micro_batch(config: GPTConfig, rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch at `step`: (inputs, next-character targets), each (batch, block_size).

    Drawn from a generator seeded by (seed, step, rank) alone, so the batch does not depend on thread
    timing, on the stage, or on whether the run is virtual or real. A single device training on the
    global batch concatenates the micro-batches of ranks 0..N-1.
    """
    ids, alphabet = corpus()
    if config.vocab_size < len(alphabet):
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the corpus alphabet ({len(alphabet)})")
    if config.block_size + 1 > ids.numel():
        raise ValueError(f"block_size {config.block_size} is longer than the corpus ({ids.numel()} characters)")
    generator = torch.Generator().manual_seed(((seed * 1_000_003) + step) * 65_537 + rank)
    starts = torch.randint(0, ids.numel() - config.block_size - 1, (config.micro_batch_size,), generator=generator)
    inputs = torch.stack([ids[s : s + config.block_size] for s in starts.tolist()])
    targets = torch.stack([ids[s + 1 : s + 1 + config.block_size] for s in starts.tolist()])
    return inputs, targets


def global_batch(config: GPTConfig, world_size: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches of all ranks at `step`, concatenated in rank order (for single-device oracles)."""
    pairs = [micro_batch(config, rank, step, seed) for rank in range(world_size)]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
