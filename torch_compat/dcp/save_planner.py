"""Save: each rank encodes its own local shards of every moment pair into one container
per shard, written as a DCP bytes item, and records the manifest (`GuardedSavePlanner`)."""
from __future__ import annotations

__all__ = ['GuardedSavePlanner']

import dataclasses
import hashlib
import io
import math
import os
import time

import torch

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from jaxguard import uncovered, writer
from jaxguard.format import container, reader
from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.core.config import save_spec
from torch_compat import state as _state
from torch_compat.dcp.layout import (FORMAT, MANIFEST_KEY, MOMENTS, SHARD_PREFIX, chunk_items, group_of,
                                     offsets_key, optimizer_roots, tensor_sha256)


# ---------------------------------------------------------------- save
class GuardedSavePlanner(DefaultSavePlanner):
    """A `DefaultSavePlanner` that writes every Adam/AdamW moment pair as guarded shards.

    Args:
      tau: the update-difference bound, as a fraction of lr (default: the spec's, 0.01).
      clip: the gradient range ``|g| <= clip`` the certificate covers (default: the spec's, 0.2).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``); `tau`,
        `clip`, `codec` override its fields when given (the ablation switches ``bound`` and
        ``partition`` are set on the spec only).
      op_model: the kernel the run resumes on (`torch_compat.state.op_model_of`; None: the
        one torch runs where the state lives).
      lr: the next step's learning rate, if the param groups do not hold it (saved before
        ``scheduler.step()``): a number or ``(lo, hi)`` for every group; a group whose next
        rate is 0 keeps its moments as plain DCP tensors (listed in the manifest's
        ``stored_exactly``).
      uncertifiable: ``"exact"`` (default, `jaxguard.uncovered`): state the guard cannot
        certify (bfloat16/float16 parameters or moments, amsgrad and the other flags
        outside the op models, an optimizer that is not Adam) stays plain DCP tensors,
        listed with the reason in the manifest's ``stored_exactly``, with one warning
        line; ``"refuse"``: such a save raises instead.
      overwrite: save into a directory that already holds a DCP checkpoint (default False:
        refused, since DCP rewrites its rank files in place and an interrupted save then
        leaves neither checkpoint; a directory per step keeps the last one whole).
      **kwargs: passed to `DefaultSavePlanner` (``flatten_state_dict`` must stay True;
        plan caching is refused: the hashes change with every save).

    The state_dict passed to ``dcp.save`` must hold the model's parameters next to the
    optimizer state (``{"model": msd, "optim": osd}`` from ``get_state_dict``): each
    moment shard is certified against the parameter shard it updates.

    Raises:
      ConfigError: a bad tau/clip/codec, or flatten_state_dict/plan caching requested.
      CheckpointError / UnsupportedOptimizerError (wrapped by DCP in a
        ``CheckpointException``): a parameter is missing or shaped otherwise than its
        moments; (``uncertifiable="refuse"``) the state is not float32 Adam/AdamW state.

    Warns:
      JaxguardWarning: (``uncertifiable="exact"``) one line naming what was stored exactly
        and why (`jaxguard.uncovered.warn`).
    """

    def __init__(self, tau: float | None = None, clip: float | None = None, *, spec=None, codec: str | None = None,
                 op_model: str | None = None, overwrite: bool = False, lr=None, uncertifiable: str = "exact",
                 **kwargs):
        for switch in ("bound", "partition"):   # not DefaultSavePlanner's: say where they went
            if switch in kwargs:
                raise ConfigError(f"GuardedSavePlanner takes {switch} on the spec: "
                                  f"spec=jaxguard.GuardSpec({switch}={kwargs[switch]!r})")
        if kwargs.get("flatten_state_dict", True) is not True:
            raise ConfigError("GuardedSavePlanner needs flatten_state_dict=True (it finds the moments by their paths)")
        if kwargs.get("enable_plan_caching"):
            raise ConfigError("GuardedSavePlanner does not support enable_plan_caching=True: every save records new hashes")
        super().__init__(**kwargs)
        self.spec = save_spec(spec, tau=tau, clip=clip, codec=codec)
        self.update = _state.torch_update_request(lr=lr, op_model=op_model, uncertifiable=uncovered.policy(uncertifiable))
        self.overwrite = overwrite
        s = self.spec
        self.tau, self.clip, self.codec, self.bound, self.partition = s.tau, s.clip, s.codec, s.bound, s.partition
        self.summary: dict = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        """`DefaultSavePlanner.set_up_planner`, keeping the nested state_dict to find the optimizer in.

        Args:
          state_dict, storage_meta, is_coordinator: as `DefaultSavePlanner.set_up_planner`.
        """
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._nested = state_dict
        where = getattr(storage_meta, "checkpoint_id", None)
        if not self.overwrite and where is not None and os.path.isfile(os.path.join(os.fspath(where), ".metadata")):
            # DCP rewrites the rank files of a directory in place: a save that stops half way loses the old one
            raise CheckpointError(f"{where} holds a committed DCP checkpoint, which DCP would overwrite in place (a "
                                  "save that stops half way loses it); save each step to its own directory, or "
                                  "pass GuardedSavePlanner(overwrite=True)")

    def create_local_plan(self):
        """Certify and encode this rank's moment shards, then plan the rest as DCP would.

        Returns:
          The local `SavePlan` (the encoded shards as bytes items, the moment tensors dropped).

        Raises:
          CheckpointError, UnsupportedOptimizerError: see the class docstring.
        """
        t0 = time.perf_counter()
        local = self._encode_local_shards()
        plan = super().create_local_plan()
        tensors, blobs = {}, {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                blobs[item.index.fqn] = hashlib.sha256(self._blob(item.index.fqn)).hexdigest()
            else:
                obj = find_state_dict_object(self.state_dict, item.index)
                tensors[offsets_key(item.index.fqn, item.index.offset)] = tensor_sha256(obj)
        local.update(tensors=tensors, bytes=blobs, seconds=time.perf_counter() - t0)
        self.plan = dataclasses.replace(plan, planner_data={"mappings": plan.planner_data, "jaxguard": local})
        return self.plan

    def _blob(self, fqn) -> bytes:
        if fqn not in self._blobs:
            buf = io.BytesIO()
            torch.save(self.state_dict[fqn], buf)  # what DefaultSavePlanner.transform_object writes
            self._blobs[fqn] = buf.getvalue()
        return self._blobs[fqn]

    def _encode_local_shards(self) -> dict:
        self._blobs: dict = {}
        roots = optimizer_roots(self._nested)
        refuse = self.update.uncertifiable == uncovered.REFUSE
        bad_groups = {}
        for root, osd in roots.items():
            for gi, g in enumerate(osd["param_groups"]):
                u = _state.group_uncovered(gi, g, who="GuardedSavePlanner")
                if u is not None and refuse:
                    raise u.error
                bad_groups[(root, gi)] = u
        pairs: dict = {}
        for key, path in list(self.mappings.items()):
            if len(path) >= 3 and path[-1] in MOMENTS and path[-3] == "state" and tuple(path[:-3]) in roots:
                pairs.setdefault((tuple(path[:-3]), path[-2]), {})[path[-1]] = key
        # one MomentJob per local shard, placed by its offsets and sizes (the entry stores the offsets only)
        jobs, entries, exact = [], {}, {}
        for (root, fqn), keys in pairs.items():
            if set(keys) != set(MOMENTS):
                raise CheckpointError(f"optimizer state {fqn!r} has {sorted(keys)} but not both exp_avg and exp_avg_sq")
            osd = roots[root]
            gi, group = group_of(osd, fqn, root)
            u = bad_groups.get((root, gi)) or self._pair_uncovered(fqn, keys, root)
            if u is not None:     # uncertifiable="exact": the pair stays plain DCP tensors, stored exactly
                if refuse:
                    raise u.error
                exact[(root, fqn)] = u.why
                continue
            step = _state.step_count(osd["state"][fqn], fqn)
            update = _state.next_update(group, step, op_model=self.update.op_model, lr=self.update.lr,
                                        device_type=osd["state"][fqn]["exp_avg"].device.type)
            if update.stores_exactly:     # next lr 0: the pair stays plain DCP tensors, stored exactly
                exact[(root, fqn)] = _state.EXACT_REASON
                continue
            cfg = _state.writer_config(self.spec, update)
            m_key, v_key = keys["exp_avg"], keys["exp_avg_sq"]
            p_key = self._param_key(fqn, root)
            m, v, p = self.state_dict[m_key], self.state_dict[v_key], self.state_dict[p_key]
            if not (m.shape == v.shape == p.shape):
                raise CheckpointError(f"parameter {fqn!r} has shape {tuple(p.shape)} but its moments "
                                      f"{tuple(m.shape)}; the model and optimizer do not match")
            chunks = [chunk_items(k, t) for k, t in ((m_key, m), (v_key, v), (p_key, p))]
            if not (len({tuple((o, s) for o, s, _ in c) for c in chunks}) == 1):
                raise CheckpointError(f"the local shards of {fqn!r} and of its moments differ; shard the parameter "
                                      "and the optimizer state alike (FSDP2 does)")
            prefix = m_key[:-len(".exp_avg")]
            entry = {"m_key": m_key, "v_key": v_key, "m_path": list(self.mappings[m_key]),
                     "v_path": list(self.mappings[v_key]), "param": fqn, "param_key": p_key,
                     "shape": [int(d) for d in m.shape], "op_model": cfg.op_model}
            entries[prefix] = entry
            for (off, size, mi), (_, _, vi), (_, _, pi) in zip(*chunks):
                if math.prod(size) == 0:
                    continue
                m, v, p = (_state.encoder_view(find_state_dict_object(self.state_dict, i)) for i in (mi, vi, pi))
                jobs.append(writer.MomentJob(prefix, m, v, p, cfg, {"param": fqn, "offsets": list(off),
                                                                    "global_shape": entry["shape"]},
                                             param=fqn, shape=tuple(entry["shape"]), offsets=tuple(off),
                                             sizes=tuple(size)))
        moments = {prefix: {**entry, "shards": []} for prefix, entry in entries.items()}
        totals = {**writer.new_totals(), "container_bytes": 0}
        for job, e in zip(jobs, writer.container_entries(jobs, totals)):
            prefix, cfg, off, size = job.name, job.config, job.offsets, job.sizes
            key = offsets_key(SHARD_PREFIX + prefix, off)
            data = container.build([e], {"framework": "torch-dcp", "moment": prefix, "offsets": list(off)},
                                   extra_header={"op_model": cfg.op_model, "tau": cfg.tau, "clip": cfg.clip,
                                                 "codec": cfg.codec, "bound": cfg.bound, "partition": cfg.partition})
            header, _ = reader.parse(data)
            self._blobs[key] = data
            self.state_dict[key] = key  # a placeholder: DCP plans a bytes item, resolve_data returns the container
            stats = {k: e.encoded.stats[k] for k in ("coordinates", "escapes", "exact", "payload_bytes", "raw_fp32_bytes")}
            moments[prefix]["shards"].append({
                "key": key, "offsets": list(off), "sizes": list(size), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "decoded_sha256": header["decoded_sha256"],
                "config": cfg.to_json(), "stats": stats})
            totals["container_bytes"] += len(data)
        for (root, fqn), keys in pairs.items():  # even a rank with only empty shards drops the tensors
            if (root, fqn) in exact:
                continue
            for k in keys.values():
                self.state_dict.pop(k, None)
                self.mappings.pop(k, None)
        for (root, gi), u in bad_groups.items():    # an optimizer that is not Adam: its state stays plain too
            if u is not None:
                osd = roots[root]
                exact.update({(root, fqn): u.why for fqn in osd["param_groups"][gi].get("params", ())
                              if fqn in osd["state"] and (root, fqn) not in exact})
        self.summary = totals
        stored = sorted(({"param": ".".join(map(str, root + (fqn,))), "why": why} for (root, fqn), why in exact.items()),
                        key=lambda x: x["param"])
        if self.update.uncertifiable == uncovered.EXACT:
            uncovered.warn("GuardedSavePlanner", [s for s in stored if s["why"] != _state.EXACT_REASON],
                           of=sum(len(osd["state"]) for osd in roots.values()))
        return {"moments": moments, "totals": totals, "stored_exactly": stored}

    def _pair_uncovered(self, fqn, keys, root):
        """Why the moment pair of `fqn` cannot be certified (not float32 parameter or moments), or None."""
        p = self.state_dict.get(self._param_key(fqn, root))
        for what, key in (("moments", keys["exp_avg"]), ("moments", keys["exp_avg_sq"]), ("parameters", None)):
            t = p if key is None else self.state_dict[key]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                dt = str(getattr(t, "dtype", type(t).__name__)).replace("torch.", "")
                return _state.Uncovered(f"{dt} {what} (the guarantee covers float32)", UnsupportedOptimizerError(
                    f"{'parameter' if key is None else key.rsplit('.', 1)[-1]} of {fqn!r} is {dt}; the guarantee "
                    "covers float32 parameters and moments"))
        return None

    def _param_key(self, fqn, root):
        hits = [k for k, path in self.mappings.items()
                if path and path[-1] == fqn and tuple(path[:len(root)]) != root
                and isinstance(self.state_dict.get(k), torch.Tensor)]
        if len(hits) != 1:
            what = "no" if not hits else f"{len(hits)} ({', '.join(hits[:3])})"
            raise CheckpointError(f"GuardedSavePlanner found {what} model entries for parameter {fqn!r}; save the "
                                  "model and optimizer together: dcp.save({'model': msd, 'optim': osd}) with "
                                  "msd, osd = get_state_dict(model, optimizer)")
        return hits[0]

    def create_global_plan(self, all_plans):
        """The coordinator's plan: DCP's, plus the manifest (hashes, shards, totals) in its metadata.

        Args:
          all_plans: every rank's local plan.

        Returns:
          ``(global plans, metadata)``.

        Raises:
          CheckpointError: the ranks' shards do not cover a moment tensor exactly once.
        """
        locals_ = [p.planner_data["jaxguard"] for p in all_plans]
        plans = [dataclasses.replace(p, planner_data=p.planner_data["mappings"]) for p in all_plans]
        global_plan, metadata = super().create_global_plan(plans)
        tensors, blobs, moments = {}, {}, {}
        for rank, plan in enumerate(global_plan):   # deduplicated: the hash of the rank that writes it
            loc = locals_[rank]
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    blobs[item.index.fqn] = loc["bytes"][item.index.fqn]
                else:
                    k = offsets_key(item.index.fqn, item.index.offset)
                    tensors[k] = loc["tensors"][k]
        for loc in locals_:
            for prefix, entry in loc["moments"].items():
                e = moments.setdefault(prefix, {**entry, "shards": []})
                have = {s["key"] for s in e["shards"]}
                e["shards"] += [s for s in entry["shards"] if s["key"] not in have]
        for prefix, e in moments.items():
            e["shards"].sort(key=lambda s: s["offsets"])
            covered = sum(math.prod(s["sizes"]) for s in e["shards"])
            if covered != math.prod(e["shape"]):
                raise CheckpointError(f"the ranks' shards of {prefix!r} cover {covered} of {math.prod(e['shape'])} "
                                      "coordinates; every coordinate must be saved by exactly one shard")
        manifest = {"format": FORMAT, "tau": self.tau, "clip": self.clip, "codec": self.codec, "bound": self.bound,
                    "partition": self.partition, "world_size": len(all_plans), "torch_version": torch.__version__,
                    "moments": moments, "tensors": tensors, "bytes": blobs,
                    "totals": {k: sum(loc["totals"][k] for loc in locals_) for k in locals_[0]["totals"]},
                    "stored_exactly": sorted({x["param"]: x for loc in locals_ for x in loc.get("stored_exactly", ())
                                              }.values(), key=lambda x: x["param"]),
                    "encode_seconds_per_rank": [loc["seconds"] for loc in locals_]}
        pd = dict(metadata.planner_data or {})
        pd[MANIFEST_KEY] = manifest
        metadata = dataclasses.replace(metadata, planner_data=pd)
        self.metadata = metadata
        return global_plan, metadata

    def resolve_data(self, write_item):
        """Args: write_item: a planned item.  Returns: its bytes (a guarded shard's container) or tensor."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._blob(write_item.index.fqn))
        return super().resolve_data(write_item)
