"""The next update of every moment pair of an optax state (`plan_updates`): from the
arguments (numbers, schedules, intervals, per-parameter prefixes), the state's
``inject_hyperparams`` values, or read from the optax transformation itself (``tx=``)."""
from __future__ import annotations

__all__ = ["platforms_of", "site_config", "AGREE", "EXACT_REASON", "SitePlan", "plan_updates", "updates_by_pair",
           "exact_reasons", "stored_exactly"]

import warnings
from typing import NamedTuple

import jax
import numpy as np

from jaxguard.core.config import GuardConfig, GuardSpec, NextUpdate, UpdateRequest, is_interval, lr_bounds, save_spec
from jaxguard.core.opmodel import is_decoupled, resolve_optax_op_model, validate_hparams
from jaxguard.errors import CheckpointError, ConfigError, JaxguardWarning, UnsupportedOptimizerError
from jaxguard.optax_state.paths import NO_ADAM, AdamSite, dotted, find_adam_states, flat_by_dotted, moment_pairs
from jaxguard.uncovered import policy as uncovered_policy


# ---------------------------------------------------------------- the next update of one site
ADAMW_LAYOUT = ("the Adam state at {path!r} is laid out as optax.adamw's (scale_by_adam, a stateless transform, "
                "then the learning rate), whose weight decay the state does not record: pass weight_decay= "
                "(optax.adamw's default is 1e-4; weight_decay=0.0 if the chain has no add_decayed_weights)")
NO_LR = ("no learning rate for the Adam state at {path!r}: pass lr= (the learning rate of the next "
         "update, a float, or the optax schedule, evaluated at the state's count)")
LAST_LR = ("the Adam state at {path!r} sits in inject_hyperparams, whose learning_rate {last:g} is the last "
           "update's and a schedule may change it: pass lr= (the next update's learning rate, e.g. lr={last:g} "
           "for a constant one, or lr=schedule, evaluated at the state's count {count})")


def platforms_of(tree) -> set:
    """The jax platforms (``Device.platform``: ``"cpu"``, ``"gpu"``, ...) `tree`'s arrays live on.

    Args:
      tree: any pytree; only its `jax.Array` leaves (and `jax.ShapeDtypeStruct`s with a
        sharding) count: numpy and Python leaves are host values and name no device.

    Returns:
      The set of platform names (empty when no leaf names a device).
    """
    out = set()
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
        if sharding is not None:
            out |= {d.platform for d in sharding.device_set}
    return out


def site_config(site: AdamSite, *, lr=None, weight_decay=None, betas=None, eps=None, spec: GuardSpec | None = None,
                lr_from_state=False, op_model=None) -> GuardConfig:
    """The `GuardConfig` of one Adam site: the next update's hyperparameters.

    Args:
      lr: the next update's learning rate: a number, or a schedule (callable of the step
        count, as given to optax) evaluated at the Adam state's ``count``, which is what
        the next ``tx.update`` feeds it.  Required: an `inject_hyperparams` state holds the
        *last* update's rate, which a schedule may already have changed.
      lr_from_state: take a missing ``lr`` from the `inject_hyperparams` state anyway
        (for conversions that certify nothing, e.g. `torch_compat.from_optax`).
      site: from `jaxguard.optax_state.find_adam_states`.
      weight_decay, betas, eps: override the `inject_hyperparams` values (defaults
        0, (0.9, 0.999), 1e-8 when neither gives them).
      spec: the save's guard settings (`jaxguard.core.config.save_spec`; None: the defaults).
      op_model: the kernel the run resumes on (``optax-adam-gpu``, ...; checked against
        the weight decay); None: chosen where the site's ``mu``/``nu`` live
        (`jaxguard.core.opmodel.resolve_optax_op_model`: the XLA:GPU model when they are
        on a GPU, else the CPU one).

    Returns:
      The `GuardConfig` (op model ``optax-adamw[-gpu]`` when weight decay > 0, else
      ``optax-adam[-gpu]``).

    Raises:
      ConfigError: no ``lr`` although the state is inside `inject_hyperparams`; no
        ``weight_decay`` for a state laid out as ``optax.adamw``'s (the state does not
        record it: never guessed); a bad hyperparameter (`jaxguard.core.opmodel.validate_hparams`);
        an `op_model` that is not optax's or not this optimizer's (adam vs adamw).
      CheckpointError: no ``lr`` and no `inject_hyperparams` learning rate; a bad count.
    """
    hp = site.hparams
    count = np.asarray(site.state.count)
    if count.shape != () or not np.issubdtype(count.dtype, np.integer):
        raise CheckpointError(f"{site.name}.count is {count.dtype}{list(count.shape)}; expected an integer scalar "
                              "(the optax step count)")
    if callable(lr):
        lr_ = np.asarray(lr(count))
        if lr_.shape != () or not np.issubdtype(lr_.dtype, np.number):
            raise ConfigError(f"lr schedule returned {lr_.dtype}{list(lr_.shape)} at count {int(count)}; pass a "
                              "schedule that returns a scalar learning rate")
        lr_ = float(lr_)
    elif lr is not None:
        lr_ = lr
    elif "learning_rate" in hp and not lr_from_state:
        raise ConfigError(LAST_LR.format(path=site.name, last=hp["learning_rate"], count=int(count)))
    else:
        lr_ = hp.get("learning_rate")
    if lr_ is None:
        raise CheckpointError(NO_LR.format(path=site.name))
    if weight_decay is None and "weight_decay" not in hp and site.decay_layout:
        raise ConfigError(ADAMW_LAYOUT.format(path=site.name))
    wd = weight_decay if weight_decay is not None else hp.get("weight_decay", 0.0)
    b = tuple(betas) if betas is not None else (hp.get("b1", 0.9), hp.get("b2", 0.999))
    e = eps if eps is not None else hp.get("eps", 1e-8)
    if hp.get("eps_root", 0.0):
        raise UnsupportedOptimizerError(f"the Adam state at {site.name!r} uses eps_root={hp['eps_root']}; the "
                                        "optax op model covers eps_root=0 only")
    model = resolve_optax_op_model(decoupled=wd > 0, op_model=op_model,
                                   platforms=platforms_of((site.state.mu, site.state.nu)))
    return GuardConfig.from_spec(save_spec(spec), lr=float(lr_), step=int(count), betas=b, eps=float(e),
                                 weight_decay=float(wd), op_model=model)


# ---------------------------------------------------------------- the next update of every moment pair
UNCHECKED = ("jaxguard.save without tx=: the next update's lr, weight decay, betas and eps are taken as given and "
             "not checked against the optax transformation (a wrong lr= is certified silently); pass tx=tx")
AGREE = 1e-5     # relative: a given value and the one tx uses agree (a double and its float32, a schedule's pow)


def _is_rate_leaf(x) -> bool:
    """A leaf of an ``lr=`` / ``weight_decay=`` tree: None, a number, a schedule, an interval."""
    return (x is None or callable(x) or is_interval(x) or isinstance(x, (int, float, np.number))
            or (hasattr(x, "ndim") and hasattr(x, "dtype") and x.ndim == 0))


def per_param(value, names, what: str) -> dict:
    """The leaf of `value` that applies to each parameter: `value` itself when it is one
    leaf (a number, an optax schedule, an ``(lo, hi)`` interval, None), else `value` is a
    pytree prefix of the params (as optax's masks are) and each parameter takes the leaf
    whose dotted path is a prefix of its own.

    Args:
      value: the argument (``lr=``, ``weight_decay=``).
      names: the params' dotted names.
      what: the argument's name, for the error.

    Returns:
      {param dotted name: leaf}.

    Raises:
      ConfigError: a prefix tree that leaves a parameter without a leaf, or has a leaf
        naming no parameter (one line naming it).
    """
    if _is_rate_leaf(value):
        return {n: value for n in names}
    leaves = [(dotted(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_rate_leaf)[0]]
    out, used = {}, set()
    for n in names:
        hits = [(d, leaf) for d, leaf in leaves if d == "" or n == d or n.startswith(d + ".")]
        if len(hits) != 1:
            raise ConfigError(f"{what} is a tree with {'no leaf' if not hits else f'{len(hits)} leaves'} for param "
                              f"{n!r}; pass a pytree prefix of the params (one value per subtree), or one value")
        out[n] = hits[0][1]
        used.add(hits[0][0])
    unused = [d for d, _ in leaves if d not in used]
    if unused:
        raise ConfigError(f"{what} has a leaf at {unused[0]!r} that is no param's path or prefix; pass a pytree prefix "
                          "of the params")
    return out


def _at_count(x, count: int, what: str, name: str):
    """A rate leaf's value for the update after `count`: a schedule evaluated at it (what
    the next ``tx.update`` feeds it), an interval as ``(lo, hi)``, a number as a float."""
    if x is None:
        return None
    if callable(x):
        val = np.asarray(x(count))
        if val.shape != () or not np.issubdtype(val.dtype, np.number):
            raise ConfigError(f"{what} schedule returned {val.dtype}{list(val.shape)} at count {count} for {name!r}; "
                              "pass a schedule that returns a scalar")
        return float(val)
    if is_interval(x):
        return (float(x[0]), float(x[1]))
    try:
        return float(np.asarray(x))
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={x!r} for {name!r} is not a number, an (lo, hi) interval or a schedule") from None


def _count(site) -> int:
    count = np.asarray(site.state.count)
    if count.shape != () or not np.issubdtype(count.dtype, np.integer):
        raise CheckpointError(f"{site.name}.count is {count.dtype}{list(count.shape)}; expected an integer scalar "
                              "(the optax step count)")
    return int(count)


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= AGREE * max(abs(a), abs(b))


class SitePlan(NamedTuple):
    """One Adam site and the next update of each of its moment pairs."""

    site: AdamSite
    pairs: list         # [(MomentPair, NextUpdate)]; `NextUpdate.stores_exactly`: no certificate
    uncovered: tuple = ()   # ((MomentPair, why), ...): stored exactly (uncertifiable="exact")

    def meta(self, spec: GuardSpec) -> dict:
        """The site's record in a container's meta.

        Args:
          spec: the save's `GuardSpec`.

        Returns:
          ``{"path", "config"}``: the config of its first certified pair (older readers
          take the site's op model from it), or None when every pair is stored exactly.
        """
        certified = [u for _, u in self.pairs if not u.stores_exactly]
        cfg = GuardConfig.from_update(spec, certified[0]).to_json() if certified else None
        return {"path": self.site.name, "config": cfg}


EXACT_REASON = "the next update's learning rate is 0 (nothing to certify against): moments stored exactly"


def plan_updates(opt_state, params, *, update: UpdateRequest | None = None, sites=None, fixed=None) -> list:
    """The next update of every moment pair of `opt_state` (the typed value each entry
    records: `jaxguard.core.config.NextUpdate`).

    Without ``update.tx`` the hyperparameters are the request's (``lr`` required: numbers, optax
    schedules evaluated at each state's count, ``(lo, hi)`` intervals, or a pytree prefix
    of the params of those), ``inject_hyperparams`` values where the arguments leave them
    out, optax's defaults last; a `JaxguardWarning` says once that nothing was checked.
    With ``update.tx`` they are read from the transformation (`jaxguard.optax_probe`): every
    leaf's learning rate (certified on ``lr (1 -+ optax_probe.LR_HALF_WIDTH)``) and weight
    decay, the betas and eps checked; a given value that disagrees with what `tx` does
    is refused, as is an update the op model does not reproduce.

    Args:
      opt_state, params: the state and the params it belongs to.
      update: the `UpdateRequest` (None: an empty one): lr, weight_decay, betas, eps,
        op_model as `jaxguard.save`; tx the optax transformation the state belongs to, or
        None; uncertifiable ``"refuse"`` (raise on moments the guarantee does not cover)
        or ``"exact"`` (they go to the plans' ``uncovered``, stored exactly:
        `jaxguard.uncovered`): dtypes outside float32 (bfloat16 mu aside), ``eps_root``,
        a `tx` update the op model does not reproduce.
      sites: `find_adam_states` of `opt_state` (or of a host copy of it), if known.
      fixed: the updates an earlier call resolved for this state (`updates_by_pair` of its
        result: an orbax save resolves them before its host copy is encoded), or None;
        the request's hyperparameters are then not read.

    Returns:
      A `SitePlan` per Adam site.

    Raises:
      CheckpointError: no Adam state, moments without a matching param, a bad count, no
        ``lr`` and no ``tx``.
      ConfigError: a bad hyperparameter or prefix tree; ``tx`` disagreeing with a given
        value; no ``weight_decay`` for a state laid out as ``optax.adamw``'s without ``tx``.
      UnsupportedOptimizerError: ``eps_root != 0`` in the state; ``tx`` whose update is
        not the op model's (Nesterov, eps_root, other betas/eps, Adamax, ...).
    """
    update = UpdateRequest() if update is None else update
    lr, weight_decay, betas, eps, op_model, tx = (update.lr, update.weight_decay, update.betas, update.eps,
                                                  update.op_model, update.tx)
    sites = find_adam_states(opt_state) if sites is None else sites
    if not sites:
        raise CheckpointError(NO_ADAM)
    pflat = flat_by_dotted(params, "params")
    exact = uncovered_policy(update.uncertifiable) == "exact" or (fixed is not None and any(
        isinstance(u, str) for u in fixed.values()))
    skipped = [[] for _ in sites]
    pairs_of = [moment_pairs(site, pflat, uncovered=skipped[si] if exact else None) for si, site in enumerate(sites)]
    if fixed is not None:
        plans = []
        for si, (site, pairs) in enumerate(zip(sites, pairs_of)):
            got = [(pair, fixed[(si, pair.param)]) for pair in pairs]
            plans.append(SitePlan(site, [(p, u) for p, u in got if not isinstance(u, str)],
                                  tuple(skipped[si]) + tuple((p, u) for p, u in got if isinstance(u, str))))
        return plans
    lr_of = per_param(lr, list(pflat), "lr")
    wd_of = per_param(weight_decay, list(pflat), "weight_decay")
    readings = {}
    if tx is not None:
        readings = _read_tx(tx, opt_state, params, sites, pairs_of, pflat, betas, eps)
    else:
        warnings.warn(UNCHECKED, JaxguardWarning, stacklevel=2)
    resolved = []
    for si, (site, pairs) in enumerate(zip(sites, pairs_of)):
        hp, count = site.hparams, _count(site)
        if hp.get("eps_root", 0.0):
            if not exact:
                raise UnsupportedOptimizerError(f"the Adam state at {site.name!r} uses eps_root={hp['eps_root']}; "
                                                "the optax op model covers eps_root=0 only")
            skipped[si] += [(pair, f"eps_root={hp['eps_root']:g} (outside the op model)") for pair in pairs]
            pairs = []
        b = tuple(betas) if betas is not None else (hp.get("b1", 0.9), hp.get("b2", 0.999))
        e = eps if eps is not None else hp.get("eps", 1e-8)
        out = []
        for pair in pairs:
            given_lr = _at_count(lr_of[pair.param], count, "lr", pair.param)
            given_wd = _at_count(wd_of[pair.param], count, "weight_decay", pair.param)
            if tx is not None:
                try:
                    rate, wd, source = _from_tx(readings[pair.param], site, pair, given_lr, given_wd, count,
                                                given=update.given())
                except UnsupportedOptimizerError:
                    if not exact:
                        raise
                    skipped[si].append((pair, "an update tx makes that the op model does not reproduce (an Adam "
                                              "variant: nesterov, eps_root, nadamw, adamax, ...)"))
                    continue
            else:
                rate, source = _from_arguments(site, given_lr, count), "given"
                wd = given_wd if given_wd is not None else hp.get("weight_decay")
                if wd is None:
                    if site.decay_layout:
                        raise ConfigError(ADAMW_LAYOUT.format(path=site.name))
                    wd = 0.0
            if is_interval(wd):
                raise ConfigError(f"weight_decay={wd!r} for {pair.param!r}: give one number (an interval is for lr)")
            out.append((pair, rate, float(wd), source))
        resolved.append((site, count, b, float(e), out))
    # a named AdamW model stands for its Adam twin where a mask leaves a pair without decay,
    # as long as some pair has decay (else the name is another optimizer's: refused)
    masked = op_model is not None and any(wd > 0 for *_, out in resolved for _, _, wd, _ in out)
    plans = []
    for si, (site, count, b, e, out) in enumerate(resolved):
        platforms = platforms_of((site.state.mu, site.state.nu))
        plans.append(SitePlan(site, [(pair, NextUpdate(lr=rate, step=count, betas=b, eps=e, weight_decay=wd,
                                                       op_model=_pair_op_model(op_model, wd, platforms, masked),
                                                       source=source))
                                     for pair, rate, wd, source in out], tuple(skipped[si])))
    return plans


def updates_by_pair(plans) -> dict:
    """The updates of `plan_updates`' result, by pair (its ``fixed=``).

    Args:
      plans: `plan_updates`' result.

    Returns:
      {(site index, param dotted name): `NextUpdate`, or why it is stored exactly (a pair
      the guarantee does not cover, `SitePlan.uncovered`)}.
    """
    out = {(si, pair.param): update for si, plan in enumerate(plans) for pair, update in plan.pairs}
    out.update({(si, pair.param): why for si, plan in enumerate(plans) for pair, why in plan.uncovered})
    return out


def exact_reasons(plans) -> dict:
    """{dotted leaf path: why} of every moment leaf the plans store exactly (a next lr of 0,
    a pair the guarantee does not cover).

    Args:
      plans: `plan_updates`' result.

    Returns:
      The dict (mu and nu of each such pair).
    """
    out = {}
    for plan in plans:
        for pair, update in plan.pairs:
            if update.stores_exactly:
                out[pair.mu_path] = out[pair.nu_path] = EXACT_REASON
        for pair, why in plan.uncovered:
            out[pair.mu_path] = out[pair.nu_path] = why
    return out


def stored_exactly(plans) -> list:
    """The pairs the plans store exactly (`jaxguard.uncovered`).

    Args:
      plans: `plan_updates`' result.

    Returns:
      ``[{"param", "why"}]``.
    """
    out = [{"param": pair.param, "why": EXACT_REASON} for plan in plans for pair, u in plan.pairs if u.stores_exactly]
    return out + [{"param": pair.param, "why": why} for plan in plans for pair, why in plan.uncovered]


def _pair_op_model(op_model, wd: float, platforms, masked: bool) -> str:
    """The op model of one pair: the named one (its Adam twin where a mask leaves the pair
    without decay), else where the moments live."""
    if masked and wd == 0 and is_decoupled(op_model) and op_model.startswith("optax-adamw"):
        op_model = "optax-adam" + op_model[len("optax-adamw"):]
    return resolve_optax_op_model(decoupled=wd > 0, op_model=op_model, platforms=platforms)


def _from_arguments(site, given_lr, count):
    """The learning rate without `tx`: the argument's (required)."""
    if given_lr is not None:
        return given_lr
    if "learning_rate" in site.hparams:
        raise ConfigError(LAST_LR.format(path=site.name, last=site.hparams["learning_rate"], count=count))
    raise CheckpointError(NO_LR.format(path=site.name))


def _read_tx(tx, opt_state, params, sites, pairs_of, pflat, betas, eps) -> dict:
    """{param dotted name: `optax_probe.LeafReading`} of every moment pair."""
    from jaxguard import optax_probe
    owner = {}
    for si, pairs in enumerate(pairs_of):
        for pair in pairs:
            if pair.param in owner:
                raise UnsupportedOptimizerError(f"param {pair.param!r} has moments in two Adam states "
                                                f"({sites[owner[pair.param][0]].name!r}, {sites[si].name!r}); the op "
                                                "model is one Adam update per parameter")
            owner[pair.param] = (si, pair.param)
    cands = []
    for site in sites:
        hp = site.hparams_arrays
        b1, b2 = (betas[0], betas[1]) if betas is not None else (hp.get("b1", 0.9), hp.get("b2", 0.999))
        e = eps if eps is not None else hp.get("eps", 1e-8)
        # candidates optax cannot run (a beta that rounds to 1 divides by 0): refused as such, not by the probes
        validate_hparams(1.0, (float(b1), float(b2)), float(e), 0, 0.0, "optax-adam")
        cands.append(optax_probe.Candidates(b1, b2, e))
    names = list(pflat)
    readings = optax_probe.probe(tx, opt_state, params, [owner.get(n) for n in names], cands)
    return {n: r for n, r in zip(names, readings) if r is not None}


def _from_tx(r, site, pair, given_lr, given_wd, count, *, given: bool):
    """(lr, weight decay, source) of one pair from its `optax_probe.LeafReading` `r`,
    checked against the given values."""
    from jaxguard import optax_probe
    b = site.hparams
    where = f"tx.update's next update of {pair.param!r} (Adam state at {site.name!r}, count {count})"
    if not r.uniform:
        raise UnsupportedOptimizerError(f"{where} does not use one learning rate and weight decay for the whole leaf; "
                                        "jaxguard certifies one rate per parameter")
    for name, gap in r.gaps.items():
        if not gap <= optax_probe.TOL:
            raise UnsupportedOptimizerError(
                f"{where} is not optax's Adam{'W' if r.lr_wd else ''} with betas=({b.get('b1', 0.9):g}, "
                f"{b.get('b2', 0.999):g}), eps={b.get('eps', 1e-8):g} ({optax_probe.PROBE_WORDS[name]}: relative gap "
                f"{gap:.3g}): an Adam variant the op model does not cover (nesterov=True, eps_root, nadamw, adamax, ...) "
                "is refused; if it is plain Adam, pass its betas= and eps=")
    if not (np.isfinite(r.lr) and r.lr >= 0 and np.isfinite(r.lr_wd) and r.lr_wd * (1 if r.lr else 0) >= 0):
        raise UnsupportedOptimizerError(f"{where} has learning rate {r.lr:g} and lr * weight decay {r.lr_wd:g}; "
                                        "jaxguard certifies Adam updates with lr >= 0 and weight decay >= 0")
    wd = r.lr_wd / r.lr if r.lr > 0 else 0.0
    if given_wd is not None:
        if r.lr > 0 and not _agree(given_wd, wd):
            raise ConfigError(f"weight_decay={given_wd:g} for {pair.param!r} disagrees with {where}, which decays by "
                              f"{wd:.6g}; pass weight_decay={wd:.6g} or leave weight_decay= out (taken from tx)")
        wd = max(wd, given_wd)
    wd = wd * (1 + optax_probe.LR_HALF_WIDTH)
    if r.lr == 0:
        if given_lr is not None and lr_bounds(given_lr)[1] > 0:
            raise ConfigError(f"lr={given_lr!r} for {pair.param!r} disagrees with {where}, whose learning rate is 0; "
                              "leave lr= out (the moments are then stored exactly) or pass the transformation "
                              "the state belongs to")
        return 0.0, 0.0, "given+tx" if given else "tx"
    w = optax_probe.LR_HALF_WIDTH
    lo, hi = r.lr * (1 - w), r.lr * (1 + w)
    if given_lr is not None:
        glo, ghi = lr_bounds(given_lr)
        if not (glo * (1 - AGREE) <= r.lr <= ghi * (1 + AGREE)):
            shown = f"({glo:g}, {ghi:g})" if glo != ghi else f"{glo:g}"
            raise ConfigError(f"lr={shown} for {pair.param!r} disagrees with {where}, whose learning rate is "
                              f"{r.lr:.6g}; pass lr={r.lr:.6g} (or an interval holding it) or leave lr= out "
                              "(taken from tx)")
        lo, hi = min(lo, glo), max(hi, ghi)
    if hi > 1 or hi * wd > 1:
        raise ConfigError(f"{where} has learning rate {r.lr:g} (weight decay {wd:g}): a rate read from tx is certified "
                          f"as the interval lr (1 -+ {w:g}), which needs lr <= 1 and lr * weight decay <= 1; save "
                          "this state with lr= and without tx=")
    return (lo, hi), wd, "given+tx" if given else "tx"
