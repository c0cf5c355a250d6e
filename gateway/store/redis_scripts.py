"""Lua sources of the Redis run store: one script per operation, each the Lua twin of a function in
`gateway.store.logic`. Redis runs a script without interleaving any other command, so each operation
is atomic across every gateway process that shares the server.

A run is one hash, `<prefix>run:<run_id>`, plus a list of its steps, `<prefix>steps:<run_id>` (apart, so
that the hot path reads a run without its steps):

| field | holds |
|---|---|
| `run_id`, `agent`, `status`, `stop_reason`, `stop_detail` | strings; a missing field is `None` |
| `epoch`, `started_at`, `updated_at` | numbers as `%.17g` text |
| `u:<counter>` / `r:<counter>` | used / reserved amount, `%.17g` text |
| `o:<reservation id>` | `{"amounts": {counter: "%.17g"}, "at": "%.17g", "units": "%.17g", "output": "%.17g"}` (JSON; numbers as text; `output`: output tokens held, every choice's) |
| `l:<list>` | JSON array of strings (`[]` when empty) |
| `roots`, `roots_final`, `roots_mark`, `roots_end` | the epoch's root spans (`logic.claim_root`, script `claim_root`) |

The steps list holds each step as the JSON the caller encoded, the last `MAX_STEPS` of them. The index
`<prefix>runs` is a sorted set of run ids scored by `updated_at` (0 when unset), for listing.

Numbers leave Lua as `%.17g` text, never through `cjson.encode`, because Redis' cjson writes at most 14
significant digits: `0.1 + 0.2` would come back as `0.3` and budgets would drift from the memory and
SQLite backends. `%.17g` and `tonumber` (like cjson.decode's strtod) round-trip a double exactly.

Calling convention: KEYS = [run key, index key, steps key, writes key, write order key (these two:
`gateway.store.redis_writes`), released key (a sorted set of the reservation ids settled, released or
expired, scored by when, kept for the tombstone's seconds: `_SETTLE` charges none of them twice and
`_RESERVE` refuses them)]; ARGV = [run_id, agent, ttl_s, idle_ttl_s, payload], the payload one JSON array of the operation's arguments (`A` in the bodies, 1-based); a script
answers with one JSON text (or an integer). One string each way instead of many: the pure-Python RESP
parser costs more per element than the whole script costs in Redis.

Writes end in `touch()`: a stopped run expires `ttl_s` after its last write, an active one
`idle_ttl_s` after its last write (0: never); its steps list and its recorded tool writes expire with it
(a write still replayed while the run lives is never run twice because its record expired first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.store import logic
from gateway.store.base import RunState
from gateway.store.redis_ops import BODIES
from gateway.store.redis_writes import BODIES as WRITE_BODIES

_PRELUDE = """
local EPS = @EPS@
local K, INDEX, STEPS, RELEASED = KEYS[1], KEYS[2], KEYS[3], KEYS[6]
local RUN_ID, AGENT = ARGV[1], ARGV[2]
local TTL, IDLE_TTL = tonumber(ARGV[3]), tonumber(ARGV[4])
local A = cjson.decode(ARGV[5])

local function num(x) return string.format('%.17g', x) end

-- JSON null (None) as nil
local function opt(v)
  if v == cjson.null then return nil end
  return v
end

-- logic._fmt: Python's f"{x:.6g}" is C's %.6g
local function fmt(x)
  if x == nil then return 'none' end
  return string.format('%.6g', x)
end

local function getnum(field)
  local v = redis.call('HGET', K, field)
  if v then return tonumber(v) end
  return nil
end

local function enc_list(items)
  if #items == 0 then return '[]' end  -- cjson writes an empty table as {}
  return cjson.encode(items)
end

-- RunState(run_id, agent): epoch 1, active
local function create()
  if redis.call('EXISTS', K) == 0 then
    redis.call('HSET', K, 'run_id', RUN_ID, 'agent', AGENT, 'epoch', '1', 'status', 'active')
  end
end

-- the denial a stopped run answers with, or nil
local function stopped_denial()
  local st = redis.call('HMGET', K, 'status', 'stop_reason', 'stop_detail')
  if st[1] ~= 'stopped' then return nil end
  local reason, detail = st[2], st[3]
  if not reason or reason == '' then reason = 'stopped' end
  if not detail or detail == '' then detail = 'the run is stopped' end
  return {'deny', reason, detail}
end

-- logic.stop: the first stop wins
local function stop(reason, detail, now)
  if redis.call('HGET', K, 'status') == 'stopped' then return end
  redis.call('HSET', K, 'status', 'stopped', 'stop_reason', reason, 'stop_detail', detail,
             'updated_at', num(now))
end

-- logic.same_epoch: the epoch a stop or effects were judged on (-1: not checked) is the run's (a run
-- not there yet starts at 1); else the reply `["reset", epoch]`, before anything is written
local function reset_since(judged)
  if judged == -1 then return nil end
  local epoch = tonumber(redis.call('HGET', K, 'epoch') or '1')
  if epoch == judged then return nil end
  return cjson.encode({'reset', epoch})
end

local function start(now)
  if redis.call('HEXISTS', K, 'started_at') == 0 then redis.call('HSET', K, 'started_at', num(now)) end
end

-- logic.add: a limit breach stops the run and adds nothing; returns the denial or nil
local function add_one(counter, amount, limit, code, now)
  start(now)
  local used = getnum('u:' .. counter) or 0.0
  local current = used + (getnum('r:' .. counter) or 0.0)
  if limit ~= nil and current + amount > limit + EPS then
    local detail = counter .. ' limit ' .. fmt(limit) .. ' would be exceeded: ' .. fmt(current) .. ' used, this step adds '
      .. fmt(amount)
    if code == '' then code = counter .. '_limit' end
    stop(code, detail, now)
    return {'deny', code, detail}
  end
  redis.call('HSET', K, 'u:' .. counter, num(used + amount), 'updated_at', num(now))
  return nil
end

-- the list `name` as logic.push would leave it (append, keep the last `keep`), nothing written
local function pushed_list(name, values, keep)
  local text = redis.call('HGET', K, 'l:' .. name)
  local items = {}
  if text then items = cjson.decode(text) end
  for _, v in ipairs(values) do items[#items + 1] = v end
  if #items > keep then
    local kept = {}
    for i = #items - keep + 1, #items do kept[#kept + 1] = items[i] end
    items = kept
  end
  return items
end

-- logic.push; returns the list
local function push_list(name, values, keep)
  local items = pushed_list(name, values, keep)
  redis.call('HSET', K, 'l:' .. name, enc_list(items))
  return items
end

-- logic.claim_root on the run's fields `roots`, `roots_final` ('1'/'0'), `roots_mark` (`updated_at` as it
-- was stored when claimed: compared as text, exactly) and `roots_end`; answers '[segment, start|null]'
-- (JSON) when the caller exports the root, else nil. Writes no `updated_at`: a claim is no activity
local function claim_root(epoch, final, stopped, upto, now)
  local f = redis.call('HMGET', K, 'epoch', 'status', 'updated_at', 'roots', 'roots_final', 'roots_mark',
                       'roots_end')
  if tonumber(f[1]) ~= epoch or f[5] == '1' then return nil end
  if not final and (f[2] == 'stopped' or (upto ~= nil and tonumber(f[3] or '0') > upto)) then return nil end
  local roots = tonumber(f[4] or '0')
  if roots > 0 and (f[3] or '') == (f[6] or '') and not (final and stopped) then  -- nothing new since
    redis.call('HSET', K, 'roots_final', final and '1' or '0')
    return nil
  end
  redis.call('HSET', K, 'roots', string.format('%d', roots + 1), 'roots_final', final and '1' or '0',
             'roots_mark', f[3] or '', 'roots_end', num(now))
  return '[' .. string.format('%d', roots) .. ',' .. (f[7] or 'null') .. ']'
end

-- expiry and the listing index, after every write
local function touch()
  local st = redis.call('HMGET', K, 'status', 'updated_at')
  for _, key in ipairs({K, STEPS, KEYS[4], KEYS[5]}) do
    if st[1] == 'stopped' then
      redis.call('EXPIRE', key, TTL)
    elseif IDLE_TTL > 0 then
      redis.call('EXPIRE', key, IDLE_TTL)
    else
      redis.call('PERSIST', key)
    end
  end
  redis.call('ZADD', INDEX, st[2] or '0', RUN_ID)  -- the text: a Lua number would lose digits
end
"""


def scripts() -> dict[str, str]:
    """Operation name -> complete Lua source (prelude with `logic.EPS` + body)."""
    prelude = _PRELUDE.replace("@EPS@", repr(logic.EPS))
    return {name: prelude + body for name, body in {**BODIES, **WRITE_BODIES}.items()}


# -- the Python side of the layout ---------------------------------------------------------------


def opt_float(value: float | None) -> float | None:
    """An optional amount for a script's JSON arguments (None travels as null)."""
    return None if value is None else float(value)


def decode_reply(reply: bytes) -> RunState:
    """The answer of the `get` and `reset` scripts: {"f": [field, value, ...], "s": [step, ...]} (a reset's
    with the epoch it ended, when it claimed that epoch's root: `_RESET`)."""
    data = orjson.loads(reply)
    flat = data["f"]
    state = _decode(dict(zip(flat[::2], flat[1::2], strict=True)), data["s"])
    ended = data.get("ended")
    if ended is not None:  # a reset's: the epoch it ended and that epoch's final root
        old = data["old"]
        before = _decode(dict(zip(old["f"][::2], old["f"][1::2], strict=True)), old["s"])
        state.ended = before, (int(ended[0]), None if ended[1] is None else float(ended[1]))
    return state


def _decode(fields: Mapping[str, str], steps: list[Any]) -> RunState:
    """A run's hash and steps (layout in `redis_scripts`) as the RunState the other backends return."""
    state = RunState(run_id=fields["run_id"], agent=fields["agent"], steps=steps)
    for key, raw in fields.items():
        kind, sep, name = key.partition(":")
        if not sep:
            continue
        if kind == "u":
            state.used[name] = float(raw)
        elif kind == "r":
            state.reserved[name] = float(raw)
        elif kind == "o":
            held = orjson.loads(raw)
            state.open[name] = {
                "amounts": {c: float(a) for c, a in held["amounts"].items()},
                "at": float(held["at"]),
                "units": int(float(held.get("units", 0))),
                "output": float(held.get("output", held.get("units", 0))),
            }
        elif kind == "l":
            state.lists[name] = orjson.loads(raw)
    state.epoch = int(fields.get("epoch", "1"))
    state.status = fields.get("status", "active")
    state.stop_reason = fields.get("stop_reason")
    state.stop_detail = fields.get("stop_detail")
    for name in ("started_at", "updated_at", "roots_end"):
        if name in fields:
            setattr(state, name, float(fields[name]))
    state.roots = int(fields.get("roots", "0"))
    state.roots_final = fields.get("roots_final") == "1"
    mark = fields.get("roots_mark")
    state.roots_mark = float(mark) if mark else None
    return state


def decode_hash(fields: Mapping[bytes, bytes], steps: Sequence[bytes]) -> RunState:
    """A run as HGETALL and LRANGE answer it (`list_runs`)."""
    return _decode({k.decode(): v.decode() for k, v in fields.items()}, [orjson.loads(s) for s in steps])
