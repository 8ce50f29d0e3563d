"""The divergence check: ranks that issue different collectives raise DivergenceError.

[Note: divergence check]
Ranks that issue different collectives (a unit skipped or run in another order on some
ranks) would hang, crash the backend, or -- same-sized units swapped -- silently mix
parameters. Every collective on a group is an entry (op, unit, element count) of the
current iteration (from one root forward on the group to the next). "cheap", the default:
 * Each root keeps, per group, a tree of the iterations every rank agreed on (a trie of
   entries, with the points where an iteration ended). An iteration that walks a known
   path -- training steps, two forwards per backward, a validation forward between
   backward and step, accumulation, decoding, each in any mix -- costs a dict lookup per
   collective: no communication, no host sync, no store operation.
 * The first iteration of a root, and the rest of any iteration after an agreed turn, run
   in lockstep: every collective is compared across the group before it is issued (a
   small all-gather on the group itself, safe because every rank does it) and added to
   the tree.
 * A rank about to leave the tree (an entry, or an end, no agreed iteration had there)
   does not issue the collective: it posts its entry to the process group's store and
   waits for every peer's entry at the same (iteration, position). Peers that take the
   same turn post theirs (data-dependent control flow that every rank takes: they agree,
   go on in lockstep). A peer that did not turn is blocked in a collective the turning
   rank never joins: a wait that has not returned after collectives.STALL_SECONDS looks for an open
   check and answers with its own entry. Entries differ: DivergenceError on both, naming
   units and ranks.
On NCCL a wait does not block the host, so a peer that did not turn never answers: the
turning rank raises after the check's timeout (by default half the process group's),
naming the ranks that did not answer, before the backend's watchdog aborts the peers'
unmatched collectives; their error then reports the entries posted to the store (the
post-mortem of _peer_errors). Nothing reads the store in the steady state.
"thorough": lockstep always. "off": nothing. Set with FSDP_LITE_CHECK or
set_divergence_check().

The check of a process group lives in the group's state (``collectives.GroupState.check``),
made at the first root forward on it; ``collectives`` calls it before each collective, while
a wait stalls, and when a collective fails (its post-mortem).
"""

from __future__ import annotations

import ast
import collections
import datetime
import os
import zlib
from typing import Any

import torch

from fsdp_lite.core import collectives
from fsdp_lite.core.accounting import Tag
from fsdp_lite.core.collectives import DivergenceError, ProcessGroup, group_state

CHECK_MODES = ("off", "cheap", "thorough")
_HISTORY = 8  # iterations remembered to answer a late check
_MAX_PATH_NODES = 100_000  # a root's tree is forgotten past this (paths that never repeat)
Entry = tuple[str, str, int]
_END: Entry = ("end of iteration", "-", 0)
_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, _END[0]: 5}


class _Settings:
    """The check's mode and timeout for this process (FSDP_LITE_CHECK,
    FSDP_LITE_CHECK_TIMEOUT, set_divergence_check): configuration, not state."""

    def __init__(self) -> None:
        self.mode = os.environ.get("FSDP_LITE_CHECK", "cheap")
        if self.mode not in CHECK_MODES:
            raise ValueError(f"FSDP_LITE_CHECK must be one of {CHECK_MODES}, got {self.mode!r}")
        self.timeout = float(os.environ.get("FSDP_LITE_CHECK_TIMEOUT", 0)) or None


_SETTINGS = _Settings()


class _Path:
    """A node of a root's tree of agreed iterations: the entries seen next, and whether an
    agreed iteration ended here."""

    __slots__ = ("next", "ends")

    def __init__(self) -> None:
        self.next: dict[Entry, _Path] = {}
        self.ends = False


class _Check:
    """One process group's divergence check (see Note), kept in the group's state."""

    def __init__(self, group: ProcessGroup) -> None:
        self.peers = collectives.world_size(group) > 1 and collectives._backend(group) != "fake"
        self.iteration = 0
        self.root: str | None = None  # the root whose forward opened this iteration
        self.log: list[Entry] = []  # this iteration's collectives
        # The last iterations' logs, to answer a check a peer opened in one of them.
        self.history: collections.deque[tuple[int, list[Entry]]] = collections.deque(
            maxlen=_HISTORY
        )
        self.trees: dict[str, _Path] = {}  # per root: its agreed iterations
        self.sizes: dict[str, int] = {}  # per root: nodes in its tree
        self.at = _Path()  # where this iteration is in its root's tree
        self.lockstep = True  # compare every collective across the group before issuing it
        self._answered: set[tuple[int, int]] = set()
        self._my_last_key: str | None = None

    def watching(self) -> bool:
        return _SETTINGS.mode == "cheap" and self.peers

    def before(self, op: str, tag: Tag | None, tensor: torch.Tensor, group: ProcessGroup) -> None:
        if _SETTINGS.mode == "off" or not self.peers:
            return
        entry = (op, tag.name if tag is not None else "-", tensor.numel())
        position = len(self.log)
        self.log.append(entry)
        known = self.at.next.get(entry)
        if known is not None and not self.lockstep and _SETTINGS.mode == "cheap":
            self.at = known
            return
        if self.lockstep or _SETTINGS.mode == "thorough":
            self._compare_now(entry, position, group, tensor.device, tag)
        else:
            self._rendezvous(entry, position, group)
            self.lockstep = True  # every rank took the same turn: compare the rest now
        self.at = known if known is not None else self._grow(entry)

    def _grow(self, entry: Entry) -> _Path:
        """Add an agreed entry after the current point of the tree."""
        node = self.at.next[entry] = _Path()
        self.sizes[self.root] = self.sizes.get(self.root, 0) + 1
        return node

    def start_iteration(self, tag: Tag, group: ProcessGroup, device: torch.device) -> None:
        """At the forward of the root ``tag`` names: close the last iteration (a rank that
        ends where no agreed iteration ended checks with its peers first), open the next."""
        root = tag.name
        if _SETTINGS.mode != "off" and self.peers and self.root is not None:
            if self.lockstep or _SETTINGS.mode == "thorough":
                self._compare_now(_END, len(self.log), group, device, tag)
            elif not self.at.ends:
                self._rendezvous(_END, len(self.log), group)
            self.at.ends = True
        self.history.append((self.iteration, self.log))
        self.log = []
        self.root = root
        self.iteration += 1
        if self.sizes.get(root, 0) > _MAX_PATH_NODES:
            self.trees.pop(root, None)
            self.sizes.pop(root, None)
        tree = self.trees.get(root)
        if tree is None:
            tree = self.trees[root] = _Path()
        self.at = tree
        self.lockstep = not tree.next and not tree.ends

    # -- lockstep: compare on the group itself ---------------------------------------

    def _compare_now(
        self,
        entry: Entry,
        position: int,
        group: ProcessGroup,
        device: torch.device,
        tag: Tag | None,
    ) -> None:
        device = collectives.comm_device(group, device)
        code = [_OPS[entry[0]], zlib.crc32(entry[1].encode()), entry[2]]
        mine = torch.tensor(code, dtype=torch.int64, device=device)
        everyone = collectives.gather_ints(mine, group, f"checking {entry[0]}", tag)
        if bool((everyone.view(-1, 3) == mine).all()):
            return
        entries = collectives.all_gather_object(entry, group)
        raise DivergenceError(
            _describe(collectives.global_ranks(group), entries, self.iteration, position)
        )

    # -- off lockstep: compare through the store -------------------------------------

    def _rendezvous(self, entry: Entry, position: int, group: ProcessGroup) -> None:
        """Post ``entry`` as this rank's at (iteration, position), announce the check, and
        wait for every rank of ``group`` to post theirs; raise if they differ."""
        store, name = collectives.store(), group.group_name
        store.set(f"fsdp_lite/open/{name}", f"{self.iteration}/{position}")
        agreed = [_what(e) for e in list(self.at.next)[:3]] + (["its end"] if self.at.ends else [])
        self._answer(store, group, self.iteration, position, entry, " or ".join(agreed))

    def post_mortem(self, group: ProcessGroup) -> str | None:
        """After a collective on ``group`` failed: what a peer that opened a divergence
        check this rank never answered was about to issue, beside this rank's entry at that
        point (None without such a check, or without a store to ask)."""
        try:
            store = collectives.store()
            key = f"fsdp_lite/open/{group.group_name}"
            if not store.check([key]):
                return None
            iteration, position = (int(x) for x in store.get(key).decode().split("/"))
            if (iteration, position) in self._answered:
                return None  # a check this rank took part in (agreed, or raised then)
            base = f"fsdp_lite/check/{group.group_name}/{iteration}/{position}/"
            posted = {
                r: ast.literal_eval(store.get(base + str(r)).decode())
                for r in collectives.global_ranks(group)
                if store.check([base + str(r)])
            }
        except RuntimeError:
            return None
        log = self.log if iteration == self.iteration else None
        log = log or next((lg for i, lg in self.history if i == iteration), None) or []
        posted[collectives.global_rank()] = log[position] if position < len(log) else _END
        per_rank = "; ".join(f"rank {r}: {_what(e)}" for r, e in sorted(posted.items()))
        return (
            f"ranks took different paths at collective #{position} of iteration {iteration} "
            f"({per_rank}; what the divergence check found in the store: this rank ran on "
            "along the iterations agreed before, where the others turned). A unit ran on "
            "some ranks but not others, or in a different order: make every rank run the "
            "same units in the same order"
        )

    def answer_open_check(self, group: ProcessGroup) -> None:
        """Called while blocked in a collective: answer a check a peer opened, if any."""
        store = collectives.store()
        key = f"fsdp_lite/open/{group.group_name}"
        if not store.check([key]):
            return
        iteration, position = (int(x) for x in store.get(key).decode().split("/"))
        if (iteration, position) in self._answered:
            return
        if iteration == self.iteration and position < len(self.log):
            mine = self.log[position]
        else:
            log = next((log for i, log in self.history if i == iteration), None)
            if log is None or position > len(log):
                return  # not a point this rank passed (or remembers): nothing to answer
            mine = log[position] if position < len(log) else _END
        self._answer(store, group, iteration, position, mine)

    def _answer(
        self,
        store: Any,
        group: ProcessGroup,
        iteration: int,
        position: int,
        mine: Entry,
        agreed: str = "",
    ) -> None:
        self._answered.add((iteration, position))
        ranks = collectives.global_ranks(group)
        base = f"fsdp_lite/check/{group.group_name}/{iteration}/{position}/"
        store.set(base + str(collectives.global_rank()), repr(mine))
        keys = [base + str(r) for r in ranks]
        timeout = datetime.timedelta(
            seconds=_SETTINGS.timeout or collectives.group_timeout(group) / 2
        )
        try:
            store.wait(keys, timeout)
        except RuntimeError as e:
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise DivergenceError(
                f"fsdp_lite: rank {collectives.global_rank()} was about to issue {_what(mine)} as "
                f"collective #{position} of iteration {iteration}, where the iterations all "
                f"ranks agreed on issued {agreed or 'something else'}; ranks {missing} did "
                f"not reach that point within {timeout.total_seconds():.0f} s. A unit ran on "
                "some ranks but not others: make every rank run the same units"
            ) from e
        entries = [ast.literal_eval(v.decode()) for v in store.multi_get(keys)]
        if self._my_last_key is not None:
            store.delete_key(self._my_last_key)  # every rank is past that check
        self._my_last_key = base + str(collectives.global_rank())
        if any(e != mine for e in entries):
            raise DivergenceError(_describe(ranks, entries, iteration, position))


def _what(entry: Entry | None) -> str:
    if entry is None or entry == _END:
        return "nothing (the end of its iteration)"
    return f"{entry[0]} of unit '{entry[1]}' ({entry[2]} elements)"


def _describe(ranks: list[int], entries: list, iteration: int, position: int) -> str:
    per_rank = "; ".join(
        f"rank {r}: {_what(tuple(e))}" for r, e in zip(ranks, entries, strict=True)
    )
    return (
        f"fsdp_lite: ranks were about to issue different collectives as collective #{position} "
        f"of iteration {iteration} ({per_rank}). A unit ran on some ranks but not others, or "
        "in a different order: make every rank run the same units in the same order (no "
        "data-dependent skipping of wrapped modules)"
    )


def check_of(group: ProcessGroup) -> _Check:
    state = group_state(group)
    if state.check is None:
        state.check = _Check(group)
    return state.check  # type: ignore[return-value]


def start_iteration(root: Tag, group: ProcessGroup, device: torch.device) -> None:
    """At a root's forward: the divergence check's iteration on ``group`` ends, the next
    (of the root ``root`` names) begins (see the Note)."""
    check_of(group).start_iteration(root, group, device)


def set_divergence_check(mode: str, *, timeout: float | None = None) -> None:
    """``"cheap"`` (default: no communication in the steady-state step), ``"thorough"``
    (every collective compared across ranks before it is issued) or ``"off"``.
    ``timeout``: seconds a rank that took a different path waits for its peers before
    raising (default: half the process group's timeout)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check must be one of {CHECK_MODES}, got {mode!r}")
    _SETTINGS.mode = mode
    if timeout is not None:
        _SETTINGS.timeout = timeout
