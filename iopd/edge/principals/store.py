"""Per-principal limits in a Redis/Valkey server every edge shares.

Why scripts: a check that reads a counter and a write that follows it, as
two commands, let two edges both see room for one request (LiteLLM's limit
becomes limit x instances that way).  Here every check together with its
reservation, every settlement and every concurrency slot is **one Lua script**,
which the server runs atomically, on **its own clock** (``redis.call('TIME')``,
never stepped back: a ``last`` stamp per principal), so edges with skewed
clocks still share one window.  A call is ``EVALSHA``, and ``EVAL`` (which
also caches the script again) when the server answers ``NOSCRIPT`` -- after
a restart or a ``SCRIPT FLUSH``.

The rules are those of ``iopd.edge.principals.limiter`` (its module doc),
written once more in Lua over these keys per principal (one hash tag, so a
cluster keeps them on one shard)::

    iopd:limits:{<principal_ref>}:req    sorted set: admission id -> admission time
    iopd:limits:{<principal_ref>}:tok    sorted set: token entry id -> stamp
    iopd:limits:{<principal_ref>}:amt    hash: token entry id -> tokens
    iopd:limits:{<principal_ref>}:st     hash: tok (window total), day, day_total, last
    iopd:limits:{<principal_ref>}:slots  sorted set: admission id -> lease expiry
    iopd:limits:{<principal_ref>}:done   sorted set: settled/withdrawn ids -> forget time

``done`` makes every step idempotent and exact when an edge cannot know
whether a call reached the server (a timeout, a cancel): a settle or
withdraw sent again does nothing, and an admission or slot that arrives
after its request was withdrawn is refused.  A slot is given back
(``free_slot``) while its request waits for a provider, the admission
untouched, and an id taking a slot it still holds keeps it (a renewal
that crossed the give-back put it back).  Every key expires on its own
(the minute logs after 61 s, the day after its debt is paid, the slots after
``lease_ttl``), so an idle principal leaves nothing behind.

What an edge admitted by itself while it could not reach the server (an
outage with ``on_backend_error: local``) is written into these same keys at
recovery (:meth:`LimitsStore.record`): each admission as an entry stamped
with its own time (the server's clock less the admission's age as the edge
measured it), its tokens in the minute and the day, its lease if it still
runs, so the outage never restarts a window.

This module is the thin I/O layer: :class:`LimitsStore` sends one script per
call and returns plain values; what an outage means is ``limits_shared``'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iopd.edge.principals.decisions import Limits, PrincipalStatus, window_status
from iopd.startup import StartupError
from iopd.vocabulary import LimitName

if TYPE_CHECKING:
    import coredis

__all__ = ["KEY_PREFIX", "PROBE_REF", "Admitted", "LimitsStore", "Refused", "StoreView", "Unseen"]

KEY_PREFIX = "iopd:limits:"
#: Settled and withdrawn ids are remembered this long (s): longer than any
#: call of an edge can be in flight.
DONE_TTL_S = 120
#: The principal a health probe runs a script for: it has no keys, so the
#: script writes nothing.
PROBE_REF = "~probe"

_PRELUDE = """
-- Never a unary minus on a count: Lua's -0 reaches the server as '-0', which HINCRBY refuses.
local R, T, A, S, C, G = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local WINDOW, DAY = 60, 86400
local function fmt(x) return string.format('%.6f', x) end
local function server_now()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local last = tonumber(redis.call('HGET', S, 'last') or '0')
  if now < last then now = last end
  return now
end
local function clock()
  local now = server_now()
  redis.call('HSET', S, 'last', fmt(now))
  return now
end
local function advance(now, tpd)
  redis.call('ZREMRANGEBYSCORE', R, '-inf', now - WINDOW)
  while true do
    local old = redis.call('ZRANGEBYSCORE', T, '-inf', now - WINDOW, 'LIMIT', 0, 256)
    if #old == 0 then break end
    local gone = 0
    for _, id in ipairs(old) do gone = gone + tonumber(redis.call('HGET', A, id) or '0') end
    redis.call('HDEL', A, unpack(old))
    redis.call('ZREM', T, unpack(old))
    redis.call('HINCRBY', S, 'tok', 0 - gone)
  end
  local today = math.floor(now / DAY)
  local day = tonumber(redis.call('HGET', S, 'day') or today)
  if day ~= today then
    local total = tonumber(redis.call('HGET', S, 'day_total') or '0')
    if tpd > 0 then total = math.max(0, total - (today - day) * tpd) else total = 0 end
    redis.call('HSET', S, 'day_total', total)
  end
  redis.call('HSET', S, 'day', today)
  return today
end
local function status(now)
  local n = redis.call('ZCARD', R)
  local rr, tr = 0, 0
  local lr = redis.call('ZRANGE', R, -1, -1, 'WITHSCORES')
  if #lr > 0 then rr = tonumber(lr[2]) + WINDOW - now end
  local lt = redis.call('ZRANGE', T, -1, -1, 'WITHSCORES')
  if #lt > 0 then tr = tonumber(lt[2]) + WINDOW - now end
  return {fmt(now), n, fmt(rr), tonumber(redis.call('HGET', S, 'tok') or '0'), fmt(tr),
          tonumber(redis.call('HGET', S, 'day')), tonumber(redis.call('HGET', S, 'day_total') or '0')}
end
local function keep(now, tpd)
  redis.call('PEXPIRE', R, 61000)
  redis.call('PEXPIRE', T, 61000)
  redis.call('PEXPIRE', A, 61000)
  local days = 1
  local total = tonumber(redis.call('HGET', S, 'day_total') or '0')
  if tpd > 0 and total > 0 then days = math.max(1, math.ceil(total / tpd)) end
  local day = tonumber(redis.call('HGET', S, 'day'))
  local ttl = math.max(61, (day + days) * DAY - now + 60)
  redis.call('PEXPIRE', S, math.ceil(ttl * 1000))
end
local function done(now, id)
  redis.call('ZREMRANGEBYSCORE', G, '-inf', now)
  return redis.call('ZSCORE', G, id)
end
local function mark_done(now, id)
  redis.call('ZADD', G, now + DONE_TTL, id)
  redis.call('PEXPIRE', G, DONE_TTL * 1000 + 1000)
end
local function take(now, id, cap, ttl)
  redis.call('ZREMRANGEBYSCORE', C, '-inf', now)
  if not redis.call('ZSCORE', C, id) and redis.call('ZCARD', C) >= cap then return 0 end
  redis.call('ZADD', C, now + ttl, id)
  redis.call('PEXPIRE', C, math.ceil(ttl * 1000) + 1000)
  return 1
end
""".replace("DONE_TTL", str(DONE_TTL_S))

#: ARGV: id, rpm, tpm, tpd, tokens, max_concurrent, lease_ttl, floor.  ``floor`` below
#: ``tokens``: the request set no maximum output, and ``tokens`` is cut to the
#: windows' room, down to ``floor`` (``limit_decisions.cut_to_room``).
#: -> {'admit', day, slot(0|1), status, tokens held} | {'reject', limit, value, used, requested, wait, status}
#:    | {'done', status} (withdrawn before it arrived)
_ADMIT = """
local id = ARGV[1]
local rpm, tpm, tpd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, cap, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = clock()
local today = advance(now, tpd)
if done(now, id) then return {'done', status(now)} end
local floor = tonumber(ARGV[8])
if floor < tokens then
  local room = tokens
  if tpm > 0 then room = math.min(room, tpm - tonumber(redis.call('HGET', S, 'tok') or '0')) end
  if tpd > 0 then room = math.min(room, tpd - tonumber(redis.call('HGET', S, 'day_total') or '0')) end
  tokens = math.max(floor, room)
end
local worst = nil
local function consider(name, value, used, requested, wait)
  if worst == nil or wait > worst[5] then worst = {name, value, used, requested, wait} end
end
local count = redis.call('ZCARD', R)
if rpm > 0 and count + 1 > rpm then
  local e = redis.call('ZRANGE', R, count - rpm, count - rpm, 'WITHSCORES')
  consider('requests_per_minute', rpm, count, 1, tonumber(e[2]) + WINDOW - now)
end
local total = tonumber(redis.call('HGET', S, 'tok') or '0')
if tpm > 0 and total + tokens > tpm then
  local excess = total - (tpm - tokens)
  local wait = nil
  local entries = redis.call('ZRANGE', T, 0, 63, 'WITHSCORES')
  for i = 1, #entries, 2 do
    excess = excess - tonumber(redis.call('HGET', A, entries[i]) or '0')
    if excess <= 0 then wait = tonumber(entries[i + 1]) + WINDOW - now break end
  end
  if wait == nil then  -- beyond the first 64 entries, or more than the limit itself
    local last = redis.call('ZRANGE', T, -1, -1, 'WITHSCORES')
    wait = WINDOW
    if #last > 0 then wait = tonumber(last[2]) + WINDOW - now end
  end
  consider('tokens_per_minute', tpm, total, tokens, wait)
end
local day_total = tonumber(redis.call('HGET', S, 'day_total') or '0')
if tpd > 0 and day_total + tokens > tpd then
  local days = math.ceil((day_total + tokens - tpd) / tpd)
  consider('tokens_per_day', tpd, day_total, tokens, (today + days) * DAY - now)
end
if worst then
  keep(now, tpd)
  return {'reject', worst[1], worst[2], worst[3], worst[4], fmt(worst[5]), status(now)}
end
redis.call('ZADD', R, now, id)
if tokens > 0 then
  redis.call('ZADD', T, now, id)
  redis.call('HSET', A, id, tokens)
  redis.call('HINCRBY', S, 'tok', tokens)
end
redis.call('HINCRBY', S, 'day_total', tokens)
local slot = 0
if cap > 0 then slot = take(now, id, cap, ttl) end
keep(now, tpd)
return {'admit', today, slot, status(now), tokens}
"""

#: ARGV: id, reserved, used, tpd, admitted day.  Gives the slot back too.
_SETTLE = """
local id, reserved, used = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tpd, admitted_day = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = clock()
local today = advance(now, tpd)
if done(now, id) then return {'done', status(now)} end
mark_done(now, id)
redis.call('ZREM', C, id)
local amount = tonumber(redis.call('HGET', A, id) or '-1')
if amount >= 0 and used < amount then
  redis.call('HSET', A, id, used)
  redis.call('HINCRBY', S, 'tok', used - amount)
end
local debt = math.max(0, used - reserved)
if debt > 0 then
  redis.call('ZADD', T, now, id .. ':debt')
  redis.call('HSET', A, id .. ':debt', debt)
  redis.call('HINCRBY', S, 'tok', debt)
end
if today == admitted_day then
  redis.call('HINCRBY', S, 'day_total', used - reserved)
else
  redis.call('HINCRBY', S, 'day_total', debt)
end
keep(now, tpd)
return {'settled', status(now)}
"""

#: ARGV: id, reserved, tpd, admitted day (-1: unknown, the admission may never have arrived).
#: With the day unknown, the admission is found by its entry in the minute's
#: request log; once that has expired (an outage over a minute), the store
#: cannot tell whether it ever arrived, and leaves the day total as it is:
#: the reservation stays counted for the day (never under-counted).
_WITHDRAW = """
local id, reserved, tpd, admitted_day = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = clock()
local today = advance(now, tpd)
if done(now, id) then return {'done', status(now)} end
mark_done(now, id)
redis.call('ZREM', C, id)
local stamp = redis.call('ZSCORE', R, id)
if stamp then
  redis.call('ZREM', R, id)
  if admitted_day < 0 then admitted_day = math.floor(tonumber(stamp) / DAY) end
end
local amount = redis.call('HGET', A, id)
if amount then
  reserved = tonumber(amount)  -- what the admission held (it may have been cut to the room)
  redis.call('HDEL', A, id)
  redis.call('ZREM', T, id)
  redis.call('HINCRBY', S, 'tok', 0 - tonumber(amount))
end
if admitted_day == today then redis.call('HINCRBY', S, 'day_total', 0 - reserved) end
keep(now, tpd)
return {'withdrawn', status(now)}
"""

#: ARGV: id, max_concurrent, lease_ttl -> 1 taken, 0 full, -1 already settled/withdrawn.
_TAKE_SLOT = """
local now = server_now()
if done(now, ARGV[1]) then return -1 end
return take(now, ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
"""

#: ARGV: id -> 1 given back, 0 not held (a lease already past its expiry is
#: removed too, but was not held: it counted for nobody).  The request waits
#: for a provider again; it stays admitted (nothing is marked done).
_FREE_SLOT = """
local at = redis.call('ZSCORE', C, ARGV[1])
redis.call('ZREM', C, ARGV[1])
if at and tonumber(at) > server_now() then return 1 end
return 0
"""

#: ARGV: lease_ttl, ids... -> leases renewed.  A lease that expired meanwhile
#: (an outage longer than the TTL) is put back: its request is still running.
_RENEW = """
local now = server_now()
local ttl = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  if not done(now, ARGV[i]) then
    redis.call('ZADD', C, now + ttl, ARGV[i])
    n = n + 1
  end
end
redis.call('PEXPIRE', C, math.ceil(ttl * 1000) + 1000)
return n
"""


#: ARGV: tpd, lease_ttl, then 7 per admission made without the store:
#: id, age at admission (s), tokens at admission, debt, age at settlement,
#: settled (0|1), running with a slot (0|1)  ->  {{UTC day of each}, status}.
#: Nothing is checked (what was admitted was admitted); an entry already
#: recorded (the call sent again after a lost answer) is skipped.  A settled
#: one is marked done; a running one is an ordinary admission from now on
#: (settled, withdrawn, its lease renewed like any other).
_RECORD = """
local tpd, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = clock()
local today = advance(now, tpd)
redis.call('ZREMRANGEBYSCORE', G, '-inf', now)
local days = {}
for i = 3, #ARGV, 7 do
  local id = ARGV[i]
  local at, amount, debt = now - tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local debt_at = now - tonumber(ARGV[i + 4])
  local day = math.floor(at / DAY)
  days[#days + 1] = day
  if not redis.call('ZSCORE', G, id .. ':rec') then
    redis.call('ZADD', G, now + DONE_TTL, id .. ':rec')
    if at > now - WINDOW then
      redis.call('ZADD', R, at, id)
      if amount > 0 then
        redis.call('ZADD', T, at, id)
        redis.call('HSET', A, id, amount)
        redis.call('HINCRBY', S, 'tok', amount)
      end
    end
    if debt > 0 and debt_at > now - WINDOW then
      redis.call('ZADD', T, debt_at, id .. ':debt')
      redis.call('HSET', A, id .. ':debt', debt)
      redis.call('HINCRBY', S, 'tok', debt)
    end
    if day == today then
      redis.call('HINCRBY', S, 'day_total', amount + debt)
    elseif math.floor(debt_at / DAY) == today then
      redis.call('HINCRBY', S, 'day_total', debt)
    end
    if ARGV[i + 5] == '1' then
      redis.call('ZADD', G, now + DONE_TTL, id)
    elseif ARGV[i + 6] == '1' then
      redis.call('ZADD', C, now + ttl, id)
      redis.call('PEXPIRE', C, math.ceil(ttl * 1000) + 1000)
    end
  end
end
redis.call('PEXPIRE', G, DONE_TTL * 1000 + 1000)
keep(now, tpd)
return {days, status(now)}
""".replace("DONE_TTL", str(DONE_TTL_S))


#: What a script takes after its keys.
ScriptArg = str | int | float


@dataclass(frozen=True)
class Unseen:
    """One admission made without the store, as :meth:`LimitsStore.record` writes it."""

    key: str
    age_s: float  # since its admission, by the edge's clock
    tokens: int  # counted from its admission: the reservation, or the usage once settled
    debt: int = 0  # usage beyond the reservation, counted from its settlement
    debt_age_s: float = 0.0
    settled: bool = False
    slot: bool = False  # still running, holding one of the principal's slots

    def args(self) -> list[ScriptArg]:
        return [
            self.key,
            f"{max(0.0, self.age_s):.6f}",
            self.tokens,
            self.debt,
            f"{max(0.0, self.debt_age_s):.6f}",
            int(self.settled),
            int(self.slot),
        ]


@dataclass(frozen=True)
class StoreView:
    """A principal's windows as the server saw them at ``now`` (its clock)."""

    now: float
    requests: int
    requests_reset_s: float
    tokens: int
    tokens_reset_s: float
    day: int
    day_total: int

    @classmethod
    def parse(cls, raw: list[Any]) -> StoreView:  # a script's reply, read field by field
        return cls(
            float(raw[0]),
            int(raw[1]),
            float(raw[2]),
            int(raw[3]),
            float(raw[4]),
            int(raw[5]),
            int(raw[6]),
        )

    def status(self, ref: str, limits: Limits, elapsed: float = 0.0) -> PrincipalStatus:
        """As ``PrincipalLimiter.status_of`` builds it, ``elapsed`` seconds after it was read."""
        tpd = limits.tokens_per_day
        now = self.now + elapsed
        day_reset = 0.0
        if self.day_total:
            days = max(1, -(-self.day_total // tpd)) if tpd else 1
            day_reset = (self.day + days) * 86_400 - now

        def left(reset: float) -> float:
            return max(0.0, reset - elapsed)

        return PrincipalStatus(
            principal_ref=ref,
            limits=limits,
            in_flight=0,
            admitted=0,
            requests_per_minute=window_status(
                limits.requests_per_minute, self.requests, left(self.requests_reset_s)
            ),
            tokens_per_minute=window_status(
                limits.tokens_per_minute, self.tokens, left(self.tokens_reset_s)
            ),
            tokens_per_day=window_status(tpd, self.day_total, day_reset),
        )


@dataclass(frozen=True)
class Admitted:
    day: int
    slot: bool
    view: StoreView
    tokens: int  # what the admission holds (cut to the windows' room without a maximum output)


@dataclass(frozen=True)
class Refused:
    limit: LimitName
    limit_value: int
    used: int
    requested: int
    retry_after_s: float
    view: StoreView


class _Script:
    """One Lua script: ``EVALSHA``, then ``EVAL`` when the server answers ``NOSCRIPT``."""

    def __init__(self, body: str) -> None:
        self.text = _PRELUDE + body
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

    async def __call__(
        self, client: coredis.Redis[str], keys: list[str], args: list[ScriptArg]
    ) -> Any:  # a script's reply: its caller reads it field by field
        from coredis.exceptions import NoScriptError

        try:
            return await client.evalsha(self.sha, keys=keys, args=args)
        except NoScriptError:
            return await client.eval(self.text, keys=keys, args=args)


class LimitsStore:
    """The scripts against one server.  Every method is one round trip (see the module doc).

    Raises whatever the client raises when the server is unreachable or
    answers something that is not the script's reply; the caller bounds each
    call by ``limits.backend_timeout`` (the client's own timeouts are only a
    backstop: they count the edge's loop lag, see ``limits_shared``) and
    :meth:`rebuild` replaces a client whose connection may be left mid-reply.
    """

    _admit = _Script(_ADMIT)
    _settle = _Script(_SETTLE)
    _withdraw = _Script(_WITHDRAW)
    _take_slot = _Script(_TAKE_SLOT)
    _free_slot = _Script(_FREE_SLOT)
    _renew = _Script(_RENEW)
    _slots_held = _Script("return redis.call('ZCOUNT', C, server_now(), '+inf')")
    _record = _Script(_RECORD)

    def __init__(self, url: str, *, timeout: float, backstop: float | None = None) -> None:
        try:
            import coredis  # noqa: F401 - imported here: a quarter of a second, paid only with backend: redis
        except ImportError:
            raise StartupError(
                "cannot use", "limits.backend: redis", "coredis is not installed (pip install 'iopd[redis]')"
            ) from None

        self._url = url
        self._backstop = timeout if backstop is None else backstop
        self.client: coredis.Redis[str] = self._new_client()

    def _new_client(self) -> coredis.Redis[str]:
        import coredis

        return coredis.Redis.from_url(
            self._url,
            decode_responses=True,
            stream_timeout=self._backstop,
            connect_timeout=self._backstop,
        )

    def rebuild(self) -> coredis.Redis[str]:
        """A fresh client (to be entered) in place of one that failed: nothing of
        the old one's connections, buffers or parser state is reused."""
        self.client = self._new_client()
        return self.client

    @staticmethod
    def keys(ref: str) -> list[str]:
        base = f"{KEY_PREFIX}{{{ref}}}:"
        return [base + k for k in ("req", "tok", "amt", "st", "slots", "done")]

    async def ping(self) -> None:
        await self.client.ping()

    async def probe(self) -> None:
        """A health check as the real calls go: ``PING``, then a script whose reply is parsed."""
        pong = await self.client.ping()
        if pong != "PONG":
            raise ValueError("the store answered PING with something else")
        await self.slots_held(PROBE_REF)

    async def record(self, ref: str, tpd: int, ttl: float, unseen: list[Unseen]) -> list[int]:
        """Write admissions made without the store into it (see ``_RECORD``); their UTC days."""
        args: list[ScriptArg] = [tpd, ttl]
        for u in unseen:
            args += u.args()
        raw = await self._record(self.client, self.keys(ref), args)
        StoreView.parse(raw[1])
        days = [int(d) for d in raw[0]]
        if len(days) != len(unseen):
            raise ValueError("the store's reply does not match the call")
        return days

    async def admit(
        self,
        ref: str,
        key: str,
        limits: Limits,
        tokens: int,
        ttl: float,
        *,
        slot: bool,
        floor: int | None = None,
    ) -> Admitted | Refused | None:
        """None: ``key`` was withdrawn before this arrived.  ``floor`` (below
        ``tokens``): cut ``tokens`` to the windows' room, down to it."""
        cap = limits.max_concurrent if slot else 0
        args: list[ScriptArg] = [key, limits.requests_per_minute, limits.tokens_per_minute]
        args += [limits.tokens_per_day, tokens, cap, ttl, tokens if floor is None else floor]
        raw = await self._admit(self.client, self.keys(ref), args)
        if raw[0] == "admit":
            return Admitted(int(raw[1]), int(raw[2]) == 1, StoreView.parse(raw[3]), int(raw[4]))
        if raw[0] == "reject":
            limit: LimitName = raw[1]
            view = StoreView.parse(raw[6])
            return Refused(limit, int(raw[2]), int(raw[3]), int(raw[4]), float(raw[5]), view)
        return None

    async def settle(
        self, ref: str, key: str, reserved: int, used: int, tpd: int, day: int
    ) -> StoreView:
        raw = await self._settle(self.client, self.keys(ref), [key, reserved, used, tpd, day])
        return StoreView.parse(raw[1])

    async def withdraw(self, ref: str, key: str, reserved: int, tpd: int, day: int) -> StoreView:
        raw = await self._withdraw(self.client, self.keys(ref), [key, reserved, tpd, day])
        return StoreView.parse(raw[1])

    async def take_slot(self, ref: str, key: str, cap: int, ttl: float) -> int:
        return int(await self._take_slot(self.client, self.keys(ref), [key, cap, ttl]))

    async def free_slot(self, ref: str, key: str) -> int:
        return int(await self._free_slot(self.client, self.keys(ref), [key]))

    async def renew(self, ref: str, keys: list[str], ttl: float) -> int:
        return int(await self._renew(self.client, self.keys(ref), [ttl, *keys]))

    async def slots_held(self, ref: str) -> int:
        """A principal's leases that have not expired, on every edge together."""
        return int(await self._slots_held(self.client, self.keys(ref), []))

