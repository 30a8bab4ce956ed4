"""Adapter loads and unloads on every replica: all or nothing.

A LoRA adapter name must never exist on only part of the fleet: a rollout routed to a replica
without it would fail with 404, or a stale copy would serve it. `load_everywhere` leaves the
fleet as it was before the call, or with the adapter on every replica (the rules:
docs/serving-api.md, "Loads are all or nothing"). Replicas are reached through a `send`
callable, so the rules are tested without sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence

from ..serve.protocol import error_body, parse_error
from .replicas import LOAD_PATH, UNLOAD_PATH, BroadcastResult, Send, UpstreamError, upstream_message

NOT_VISIBLE = "No adapter found"  # vLLM's 404 for a directory its mount has not seen yet
ALREADY_LOADED = "has already been loaded"
ROLLBACK_ATTEMPTS = 3  # unload tries per replica before a rollback failure is reported


async def load_everywhere(send: Send, replicas: Sequence[str], body: dict, *, retry_s: float,
                          timeout_s: float, unload_timeout_s: float = 30.0) -> BroadcastResult:
    """Load an adapter on every replica or on none (docs/serving-api.md, "Loads are all or
    nothing")."""
    name = body["lora_name"]
    deadline = time.monotonic() + timeout_s
    failed = asyncio.Event()  # set by the first hard failure: the others stop retrying
    retries = 0
    previous: dict[str, str | None] = {}  # in place: replica -> the path it held, None: none
    if body.get("load_inplace") is True:
        held = await asyncio.gather(*(_held_path(send, r, name, unload_timeout_s)
                                      for r in replicas))
        unknown = {r: why for r, (_, why) in zip(replicas, held) if why}
        if unknown:
            message = (f"in-place load of '{name}' refused before it began: what the replicas "
                       f"hold now could not be read, so a failure could not be undone: {unknown}")
            return BroadcastResult(502, error_body(message, 502),
                                   {r: f"not read: {why}" for r, why in unknown.items()})
        previous = {r: path for r, (path, _) in zip(replicas, held)}

    async def one(replica: str) -> tuple[str, int, str]:
        """-> (state, status, text); state: ok, present, failed, lost, timeout or aborted."""
        nonlocal retries
        not_visible = False  # answered "not visible" before: the reason to report at a timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout", 504, f"still '{NOT_VISIBLE}' at the deadline"
            try:
                status, text = await send(replica, LOAD_PATH, body, remaining)
            except UpstreamError as exc:  # the answer is lost: it may have loaded it or not
                failed.set()  # its timeout was the time left: a timeout means the deadline
                if exc.kind == "timeout" and not_visible:  # the last try ran into the deadline
                    return "timeout", 504, (f"still '{NOT_VISIBLE}' at the deadline (its last "
                                            f"try: {exc.message})")
                return ("timeout" if exc.kind == "timeout" else "lost"), exc.status, exc.message
            if 200 <= status < 300:
                return "ok", status, text
            if status == 400 and ALREADY_LOADED in text:
                conflict = await _held_elsewhere(send, replica, name, body["lora_path"],
                                                 max(deadline - time.monotonic(), 1.0))
                if not conflict:
                    return "present", status, text
                failed.set()
                return "failed", 400, json.dumps(error_body(conflict, 400, "InvalidUserInput"))
            if status == 404 and NOT_VISIBLE in text:  # its mount has not caught up: wait
                retries += 1
                not_visible = True
                wait = min(retry_s, deadline - time.monotonic())
                if wait > 0:
                    try:  # sleep, but wake at once if another replica failed for good
                        await asyncio.wait_for(failed.wait(), wait)
                    except TimeoutError:
                        pass
                if failed.is_set():
                    return "aborted", status, text
                continue
            failed.set()
            return "failed", status, text

    outcomes = dict(zip(replicas, await asyncio.gather(*(one(r) for r in replicas))))
    states = {r: state for r, (state, _, _) in outcomes.items()}
    per_replica = {r: f"{state}: {upstream_message(text)}" if state != "ok" else "ok"
                   for r, (state, _, text) in outcomes.items()}
    if all(s in ("ok", "present") for s in states.values()):
        if "ok" in states.values():
            text = next(t for s, _, t in outcomes.values() if s == "ok")
            return BroadcastResult(200, text, per_replica, retries)
        return BroadcastResult(200, f"Success: LoRA adapter '{name}' was already loaded from "
                               f"{body['lora_path']} on every replica.", per_replica, retries)

    # Roll back: unload wherever it may have been loaded by this call (in place: load the
    # previous adapter again where there was one).
    undo = [r for r, s in states.items() if s in ("ok", "lost", "timeout")]
    restore = {r: previous[r] for r in undo if previous.get(r)}
    rolled_back, rollback_failed = await _unload(
        send, [r for r in undo if r not in restore], name, retry_s, unload_timeout_s)
    restored, restore_failed = await _restore(send, restore, name, retry_s, unload_timeout_s)
    rolled_back, rollback_failed = rolled_back + restored, rollback_failed + restore_failed
    rolled = f"; rolled back on {rolled_back}" if rolled_back else ""
    stuck = (f"; ROLLBACK FAILED on {rollback_failed} (the adapter may still be loaded there)"
             if rollback_failed else "")
    hard = [(r, st, t) for r, (s, st, t) in outcomes.items() if s in ("failed", "lost")]
    if hard:  # the first replica that failed for good names the status
        replica, status, text = hard[0]
        message = (f"loading adapter '{name}' failed on {replica}: {upstream_message(text)}"
                   f"{rolled}{stuck}")
        err_type = None
        if status < 502:  # an HTTP answer: keep its status and type (400 stays 400, 500 stays 500)
            err_type = parse_error(text)[1]
        return BroadcastResult(status, error_body(message, status, err_type), per_replica,
                               retries, rolled_back, rollback_failed)
    waiting = {r: text for r, (s, _, text) in outcomes.items() if s == "timeout"}
    message = (f"adapter '{name}' was not loaded on every replica within {timeout_s} s "
               f"(retried every {retry_s} s): {waiting}{rolled}{stuck}")
    return BroadcastResult(504, error_body(message, 504), per_replica, retries, rolled_back,
                           rollback_failed, timed_out=True)


async def _held_path(send: Send, replica: str, name: str,
                     timeout_s: float) -> tuple[str | None, str]:
    """(the path `replica` holds adapter `name` from, or None if it holds none; '') or
    (None, why its /v1/models could not tell)."""
    try:
        status, text = await send(replica, "/v1/models", None, timeout_s, "GET")
        if status != 200:
            return None, f"/v1/models answered {status}"
        cards = json.loads(text)["data"]
        return next((c.get("root") for c in cards if c.get("id") == name), None), ""
    except UpstreamError as exc:
        return None, exc.message
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"/v1/models is not a model list ({exc})"


async def _restore(send: Send, previous: dict[str, str], name: str, retry_s: float,
                   timeout_s: float) -> tuple[list[str], list[str]]:
    """Load `name` in place from each replica's previous path again (an in-place load's
    rollback), retrying a few times. Returns (restored, failed) replicas."""

    async def one(replica: str) -> bool:
        body = {"lora_name": name, "lora_path": previous[replica], "load_inplace": True}
        for attempt in range(ROLLBACK_ATTEMPTS):
            if attempt:
                await asyncio.sleep(retry_s)
            try:
                status, _ = await send(replica, LOAD_PATH, body, timeout_s)
            except UpstreamError:
                continue
            if 200 <= status < 300:
                return True
        return False

    done = dict(zip(previous, await asyncio.gather(*(one(r) for r in previous))))
    return [r for r, ok in done.items() if ok], [r for r, ok in done.items() if not ok]


async def _held_elsewhere(send: Send, replica: str, name: str, path: str,
                          timeout_s: float) -> str:
    """'' if `replica` holds adapter `name` from `path` (its /v1/models card's `root`), else
    why the load must fail."""
    try:
        status, text = await send(replica, "/v1/models", None, timeout_s, "GET")
        cards = json.loads(text)["data"] if status == 200 else None
        held = next((c.get("root") for c in cards if c.get("id") == name), None)
    except UpstreamError as exc:
        return f"{replica} says '{name}' is already loaded; its /v1/models: {exc.message}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return (f"{replica} says '{name}' is already loaded, and its /v1/models (status "
                f"{status}) does not say from where")
    if isinstance(held, str) and os.path.normpath(held) == os.path.normpath(path):
        return ""
    return (f"{replica} already holds an adapter named '{name}' loaded from {held}, not from "
            f"{path}: it would serve that one. Publish under a new name, or unload '{name}' "
            "first")


async def unload_everywhere(send: Send, replicas: Sequence[str], body: dict, *,
                            retry_s: float, timeout_s: float = 30.0) -> BroadcastResult:
    """Unload an adapter from every replica. 404 on some replicas is fine (already gone there);
    404 on all is relayed (unknown name); other failures are retried, then reported (502)."""
    name = body["lora_name"]
    removed, failed = await _unload(send, list(replicas), name, retry_s, timeout_s, keep=True)
    per_replica = {r: "removed" if r in removed else "absent" for r in replicas}
    per_replica.update({r: f"failed: {why}" for r, why in failed.items()})
    if failed:
        replica, why = next(iter(failed.items()))
        message = (f"unloading adapter '{name}' failed on {replica}: {why} (removed on "
                   f"{removed}); the name may still be loaded there, retry the unload")
        return BroadcastResult(502, error_body(message, 502), per_replica)
    if not removed:
        message = f"The lora adapter '{name}' cannot be found."
        return BroadcastResult(404, error_body(message, 404), per_replica)
    return BroadcastResult(200, f"Success: LoRA adapter '{name}' removed successfully.",
                           per_replica)


async def _unload(send: Send, replicas: list[str], name: str, retry_s: float, timeout_s: float,
                  keep: bool = False):
    """Unload `name` on each replica, retrying failures a few times. Returns (removed, failed):
    the replicas that answered 2xx, and {replica: reason} (a list of names unless `keep`)."""

    async def one(replica: str) -> tuple[str, str]:
        why = ""
        for attempt in range(ROLLBACK_ATTEMPTS):
            if attempt:
                await asyncio.sleep(retry_s)
            try:
                status, text = await send(replica, UNLOAD_PATH, {"lora_name": name}, timeout_s)
            except UpstreamError as exc:
                why = exc.message
                continue
            if 200 <= status < 300:
                return "removed", ""
            if status == 404:
                return "absent", ""
            why = f"{status} {upstream_message(text)}"
            if 400 <= status < 500:
                break  # a 4xx will not change on a retry
        return "failed", why

    results = dict(zip(replicas, await asyncio.gather(*(one(r) for r in replicas))))
    removed = [r for r, (state, _) in results.items() if state == "removed"]
    failed = {r: why for r, (state, why) in results.items() if state == "failed"}
    return removed, (failed if keep else list(failed))

