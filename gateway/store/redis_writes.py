"""Side-effecting tool calls in the Redis run store: Lua twins of `gateway.store.writes.WriteBook`.

Each body runs after the prelude of `gateway.store.redis_scripts`, so a claim is one script: atomic
across every gateway process that shares the server. Keys: KEYS = [run key, index key, steps key,
writes key, order key]; ARGV as in the prelude, plus ARGV[6], a result body to record (raw bytes).

Layout, apart from the run's hash (so that reading a run never reads recorded results):
| key | holds |
|---|---|
| `<prefix>writes:<run_id>` hash | `_w`: the mark of the run it belongs to; `_n`: a counter; `e:<field>`: `{"t": token, "x": lease end (%.17g text), "d": 0|1}`; `b:<field>`: the recorded result body |
| `<prefix>writeorder:<run_id>` sorted set | each `<field>` by the counter at its first write: the oldest go first past `keep` |

`<field>` is `<epoch>:<key>` (`writes.field`): a reset run never sees its former epochs' entries.
The mark ties the entries to one life of the run: a claim puts a mark in the run's hash (field `w`)
unless it has one, and entries under another mark (the run was reset, which rewrites its hash, or it
expired and was created anew) are wiped before anything is read. The two keys take the run's time to
live at every write of theirs (its hash was just written), and every other write of the run renews it
(`touch()` in the prelude), so they expire with the run, never before it.
"""

from __future__ import annotations

_HELPERS = """
local W, Z = KEYS[4], KEYS[5]

-- entries of another life of the run are wiped; the run's mark is set by the first claim of a life
local function mark(token)
  redis.call('HSETNX', K, 'w', token)
  local current = redis.call('HGET', K, 'w')
  if redis.call('HGET', W, '_w') ~= current then
    redis.call('DEL', W, Z)
    redis.call('HSET', W, '_w', current)
  end
end

-- true when the entries belong to the run as it is (release and renew never wipe or create)
local function marked()
  local current = redis.call('HGET', K, 'w')
  return current and redis.call('HGET', W, '_w') == current
end

-- the run's time to live (its hash was written by this script's touch())
local function follow()
  local ttl = redis.call('PTTL', K)
  for _, key in ipairs({W, Z}) do
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) else redis.call('PERSIST', key) end
  end
end

local function entry(name)
  local text = redis.call('HGET', W, 'e:' .. name)
  if text then return cjson.decode(text) end
  return nil
end

local function put(name, token, lease_end, done)
  redis.call('HSET', W, 'e:' .. name, cjson.encode({t = token, x = num(lease_end), d = done}))
end

-- a new entry, last in the order; past `keep` entries, the oldest are dropped
local function insert(name, token, lease_end, done, keep)
  put(name, token, lease_end, done)
  redis.call('ZADD', Z, redis.call('HINCRBY', W, '_n', 1), name)
  local over = redis.call('ZCARD', Z) - math.max(keep, 1)
  if over > 0 then
    for _, old in ipairs(redis.call('ZRANGE', Z, 0, over - 1)) do
      redis.call('HDEL', W, 'e:' .. old, 'b:' .. old)
    end
    redis.call('ZREMRANGEBYRANK', Z, 0, over - 1)
  end
end
"""

# A: [field, token, lease end, keep, now]. Answers {'claimed'}, {'running'}, {'done'} or {'done', body}.
_CLAIM = """
local name, token, lease_end, keep, now = A[1], A[2], A[3], A[4], A[5]
create()
mark(token)
local found = entry(name)
if found == nil then
  insert(name, token, lease_end, 0, keep)
elseif found.d == 1 then
  local body = redis.call('HGET', W, 'b:' .. name)
  if body then return {'done', body} end
  return {'done'}
elseif found.t == token or tonumber(found.x) <= now then  -- its holder's lease ran out: presumed dead
  put(name, token, lease_end, 0)
else
  return {'running'}
end
touch()
follow()
return {'claimed'}
"""

# A: [field, token, lease end]. Answers 1 when the token's claim was extended.
_RENEW = """
local name, token = A[1], A[2]
if not marked() then return 0 end
local found = entry(name)
if found == nil or found.d == 1 or found.t ~= token then return 0 end
put(name, token, A[3], 0)
return 1
"""

# A: [field, token, keep]; ARGV[6]: the result body, when recorded. Answers 1 when it recorded.
_FINISH = """
local name, token, keep = A[1], A[2], A[3]
create()
mark(token)
local found = entry(name)
if found ~= nil and found.d == 1 then return 0 end  -- the first result stands
if found == nil then insert(name, token, 0, 1, keep) else put(name, token, 0, 1) end
if ARGV[6] then redis.call('HSET', W, 'b:' .. name, ARGV[6]) end
touch()
follow()
return 1
"""

# A: [field, token]. Answers 1 when the token's claim was dropped.
_RELEASE = """
local name, token = A[1], A[2]
if not marked() then return 0 end
local found = entry(name)
if found == nil or found.d == 1 or found.t ~= token then return 0 end
redis.call('HDEL', W, 'e:' .. name, 'b:' .. name)
redis.call('ZREM', Z, name)
return 1
"""

BODIES = {
    "claim_write": _HELPERS + _CLAIM,
    "renew_write": _HELPERS + _RENEW,
    "finish_write": _HELPERS + _FINISH,
    "release_write": _HELPERS + _RELEASE,
}
