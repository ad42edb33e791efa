"""The one walk of an optax state pytree: its Adam states, its leaves by name, the next update of
every moment pair, and what every leaf becomes in a checkpoint.

Shared by every optax adapter (`jaxguard.optax_adapter` for one file,
`jaxguard.sharded` for a directory written by many processes, `jaxguard.jit_state` for
the jitted hook).  Nothing here reads an array's data: it walks trees and checks shapes
and dtypes.

A leaf is named by its *dotted path*: the key path with dict keys, attribute names and
sequence indices joined by ``"."`` (``"0.mu.dense.kernel"``).  A flat params dict
``{"dense.kernel": x}`` and a nested one ``{"dense": {"kernel": x}}`` give the same dotted
paths, which is how torch names map to JAX params (torch_compat.migrate).

The package by job: `paths` (dotted paths, Adam sites, moment pairs), `updates` (the next
update of every pair) and `layout` (what every leaf becomes; a stored leaf matched on load).
"""
from __future__ import annotations

from jaxguard.optax_state.paths import (INJECT_STATES, MU_DTYPES, NO_ADAM, AdamSite, MomentPair, dotted,
                                        dtype_name, find_adam_states, flat_by_dotted, key_str, moment_pairs)
from jaxguard.optax_state.updates import (AGREE, EXACT_REASON, SitePlan, exact_reasons, plan_updates, platforms_of,
                                          site_config, stored_exactly, updates_by_pair)
from jaxguard.optax_state.layout import StateLayout, lay_out, stored_like_leaf, warn_other_platform

__all__ = ["INJECT_STATES", "MU_DTYPES", "NO_ADAM", "key_str", "dotted", "flat_by_dotted", "dtype_name", "AdamSite",
           "find_adam_states", "MomentPair", "moment_pairs", "platforms_of", "site_config", "AGREE", "EXACT_REASON",
           "SitePlan", "plan_updates", "updates_by_pair", "exact_reasons", "stored_exactly",
           "StateLayout", "lay_out", "warn_other_platform", "stored_like_leaf"]
