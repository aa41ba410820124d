"""NICE normalizing flow as a post-hoc isotropy transform (Dinh et al. 2014; paper 000, Section 4.1.1).

The flow maps frozen token embeddings to a standard Gaussian by maximum likelihood: additive coupling layers
(volume preserving) and NICE's diagonal scaling layer. It implements
:class:`~hil.isotropy.post_transform.PostTransform` like the linear transforms, so it can be a pipeline step,
saved and loaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from hil.isotropy.linear_transforms import moments
from hil.isotropy.post_transform import PostTransform, check_fit_input

__all__ = ["NICEFlow"]


class _AdditiveCoupling(nn.Module):
    """NICE additive coupling (Dinh et al. 2014, Eq. for additive coupling): ``y_b = x_b + m(x_a)``, ``y_a = x_a``.

    Volume preserving: log|det J| = 0. ``m`` is an MLP with ReLU hidden layers; its last layer starts at zero so
    the untrained coupling is the identity.
    """

    def __init__(self, dim: int, kept: Tensor, changed: Tensor, hidden: int, hidden_layers: int):
        super().__init__()
        self.register_buffer("kept", kept)        # indices x_a (conditioning half)
        self.register_buffer("changed", changed)  # indices x_b (shifted half)
        layers: list[nn.Module] = []
        width = len(kept)
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        last = nn.Linear(width, len(changed))
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.shift_net = nn.Sequential(*layers, last)

    def _shift(self, x: Tensor, sign: float) -> Tensor:
        out = x.clone()
        out[:, self.changed] = x[:, self.changed] + sign * self.shift_net(x[:, self.kept])
        return out

    def forward(self, x: Tensor) -> Tensor:
        return self._shift(x, 1.0)

    def inverse(self, y: Tensor) -> Tensor:
        return self._shift(y, -1.0)  # x_a = y_a, so m(x_a) = m(y_a)


class NICEFlow(nn.Module, PostTransform):
    """NICE normalizing flow (Dinh et al. 2014) as used by 000 Section 4.1.1 (token-wise density estimation).

    ``f(x) = exp(log_scale) * (c_K o ... o c_1)(x - center)``: K additive coupling layers with alternating
    even/odd index partitions, then NICE's diagonal scaling layer. Additive couplings have unit Jacobian, so
    ``log|det Df(x)| = sum(log_scale)``, and under the standard Gaussian prior 000 uses (Eq. 5)
    ``log p_X(x) = sum_d log N(f(x)_d; 0, 1) + sum(log_scale)``. ``fit`` maximizes that likelihood on frozen
    embeddings; ``transform`` returns ``z = f(x)`` (L2-normalized when ``renormalize``).

    Choices: ``center`` is a fixed (non-trainable, volume-preserving) shift set to the data mean, and
    ``log_scale`` starts at ``-log(std)`` of the data, on the first ``fit`` (a data-dependent initialization in
    the spirit of Glow's ActNorm): with zero-initialized coupling outputs the untrained flow is exactly
    per-dimension standardization, and training can only improve on it. 000 used 5-layer, 1000-unit coupling
    networks and lr 1e-4 for several epochs on GPU (Section 5.1.2); the defaults here (``hidden=256``,
    ``hidden_layers=2``, lr 1e-3) are sized for a few hundred CPU steps -- pass ``hidden=1000, hidden_layers=5``
    to follow 000.
    """

    name = "nice"
    FIT_KWARGS = ("epochs", "batch_size", "lr", "seed", "max_steps", "weight_decay")

    def __init__(self, dim: int, n_couplings: int = 4, hidden: int = 256, hidden_layers: int = 2,
                 renormalize: bool = True, init_seed: int = 0):
        nn.Module.__init__(self)
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"NICEFlow: dim must be an int >= 2 (a coupling splits the vector), got {dim!r}")
        if n_couplings < 1 or hidden < 1 or hidden_layers < 0:
            raise ValueError(f"NICEFlow: need n_couplings >= 1, hidden >= 1, hidden_layers >= 0; got "
                             f"{n_couplings}, {hidden}, {hidden_layers}")
        self.dim = dim
        self.n_couplings = n_couplings
        self.hidden = hidden
        self.hidden_layers = hidden_layers
        self.renormalize = bool(renormalize)
        self.init_seed = init_seed
        even = torch.arange(0, dim, 2)
        odd = torch.arange(1, dim, 2)
        with torch.random.fork_rng(devices=[]):  # reproducible init without touching the global RNG
            torch.manual_seed(init_seed)
            self.couplings = nn.ModuleList(
                _AdditiveCoupling(dim, *((even, odd) if i % 2 == 0 else (odd, even)), hidden, hidden_layers)
                for i in range(n_couplings))
        self.log_scale = nn.Parameter(torch.zeros(dim))            # NICE diagonal scaling layer
        self.register_buffer("center", torch.zeros(dim))           # fixed shift, set from data on first fit
        self.register_buffer("initialized", torch.tensor(False))   # data-dependent init done / flow fitted
        self.fit_info: dict[str, Any] = {}
        self.history: list[float] = []  # mean training NLL (nats per vector) per epoch

    # -- flow ----------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """x (M, D) -> z = f(x) (M, D), log|det Df(x)| (M,)."""
        h = x - self.center
        for coupling in self.couplings:
            h = coupling(h)
        z = h * torch.exp(self.log_scale)
        log_det = self.log_scale.sum().expand(x.shape[0])
        return z, log_det

    def inverse(self, z: Tensor) -> Tensor:
        """z (M, D) -> x = f^{-1}(z) (M, D)."""
        h = z * torch.exp(-self.log_scale)
        for coupling in reversed(self.couplings):
            h = coupling.inverse(h)
        return h + self.center

    def log_prob(self, x: Tensor) -> Tensor:
        """000 Eq. 5 with a standard Gaussian p_Z: log p_X(x) = log p_Z(f(x)) + log|det Df(x)|. x (M, D) -> (M,)"""
        z, log_det = self(x)
        log_pz = -0.5 * (z ** 2).sum(dim=-1) - 0.5 * self.dim * math.log(2 * math.pi)
        return log_pz + log_det

    # -- PostTransform -------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {"dim": self.dim, "n_couplings": self.n_couplings, "hidden": self.hidden,
                "hidden_layers": self.hidden_layers, "renormalize": self.renormalize, "init_seed": self.init_seed}

    @property
    def fitted(self) -> bool:
        return bool(self.initialized)

    @property
    def input_dim(self) -> int:
        return self.dim

    @property
    def output_dim(self) -> int:
        return self.dim

    @torch.no_grad()
    def _data_init(self, x: Tensor) -> None:
        mean, cov = moments(x)
        std = torch.sqrt(torch.diagonal(cov).clamp_min(1e-12))
        self.center.copy_(mean.to(self.center.dtype))
        self.log_scale.copy_((-torch.log(std)).to(self.log_scale.dtype))
        self.initialized.fill_(True)

    def fit(self, x: Tensor, epochs: int = 10, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
            max_steps: int | None = None, weight_decay: float = 0.0) -> "NICEFlow":
        """Maximum-likelihood training on frozen embeddings x (N, D) with Adam (000 Section 4.1.1).

        The first call also sets ``center`` and ``log_scale`` from x (see the class docstring); later calls
        continue training from the current parameters. ``seed`` fixes the minibatch order.
        """
        check_fit_input(x, "NICEFlow")
        if x.shape[1] != self.dim:
            raise ValueError(f"NICEFlow.fit: flow has dim {self.dim}, data has D={x.shape[1]}")
        param = self.log_scale
        data = x.detach().to(device=param.device, dtype=param.dtype)
        if not self.fitted:
            self._data_init(data)
        optimizer = torch.optim.Adam(self.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
        generator = torch.Generator().manual_seed(seed)
        n = data.shape[0]
        steps = 0
        self.train()
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(data.device)
            total, seen = 0.0, 0
            for start in range(0, n, batch_size):
                batch = data[order[start:start + batch_size]]
                loss = -self.log_prob(batch).mean()  # NLL in nats per vector
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * batch.shape[0]
                seen += batch.shape[0]
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
            self.history.append(total / max(seen, 1))
            if max_steps is not None and steps >= max_steps:
                break
        self.eval()
        self.fit_info = {"n_vectors": n, "dim": self.dim, "epochs": epochs, "batch_size": batch_size, "lr": lr,
                         "seed": seed, "steps": self.fit_info.get("steps", 0) + steps,
                         "final_train_nll": self.history[-1] if self.history else None}
        return self

    def _transform_flat(self, x: Tensor) -> Tensor:
        param = self.log_scale
        with torch.no_grad():
            z, _ = self(x.to(device=param.device, dtype=param.dtype))
        return z.to(device=x.device, dtype=x.dtype)

    def _state(self) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.state_dict().items()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.to(dtype=state["log_scale"].dtype)  # a flow saved in float64 loads in float64
        self.load_state_dict(state)
        self.eval()

    def __repr__(self) -> str:  # nn.Module's repr lists layers; the settings say more here
        return PostTransform.__repr__(self)
