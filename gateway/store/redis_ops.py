"""The operations of the Redis run store in Lua, each the twin of its function in `gateway.store.logic`.

Each body runs after the prelude of `gateway.store.redis_scripts` (its helpers, the layout and the
calling convention it documents): `A` is the decoded JSON array of the operation's arguments.
"""

from __future__ import annotations

# A: [now, reservation id, min_units, max_units, [[counter, fixed, per_unit, limit|null, code], ...],
#     clamp_units|null, expire_before|null, tombstone seconds, refuse only (a denial stops nothing)].
# Answers ["ok", epoch, units, counter, amount, ...] or ["deny", reason, detail(, "held")]; an error when the
# reservation id was released already (a reserve that landed after the release of its lost answer).
_RESERVE = """
if redis.call('ZSCORE', RELEASED, A[2]) then  -- one lookup of a key that rarely exists
  return redis.error_reply('RELEASED reservation ' .. A[2] .. ' was released before its reserve arrived')
end
create()
local now, rid, min_units, max_units, clamp = A[1], A[2], A[3], A[4], opt(A[6])
local denied = stopped_denial()
if denied then touch(); return cjson.encode(denied) end
start(now)
local before = opt(A[7])
if before ~= nil then  -- logic.expire: a reservation older than its lease is charged what it held
  local fields, open, expired = redis.call('HKEYS', K), false, false
  for _, field in ipairs(fields) do
    if string.sub(field, 1, 2) == 'o:' then
      local held = cjson.decode(redis.call('HGET', K, field))
      if tonumber(held['at']) < before then
        expired = true
        redis.call('HDEL', K, field)
        -- charged in full now: its step's late settle finds it settled (`_SETTLE`)
        redis.call('ZADD', RELEASED, num(now), string.sub(field, 3))
        redis.call('EXPIRE', RELEASED, A[8])
        local charged = {}  -- logic.charged
        for counter, amount in pairs(held['amounts']) do
          local left = (getnum('r:' .. counter) or 0.0) - tonumber(amount)
          if left < 0.0 then left = 0.0 end
          redis.call('HSET', K, 'r:' .. counter, num(left))
          charged[counter] = tonumber(amount)
        end
        if charged['tokens'] ~= nil then
          local output = math.min(tonumber(held['output'] or held['units'] or 0), charged['tokens'])
          charged['output_tokens'] = output
          charged['input_tokens'] = charged['tokens'] - output
          charged['unreported_usage'] = 1  -- base.UNREPORTED_USAGE: no provider said what it used
        end
        for counter, amount in pairs(charged) do
          redis.call('HSET', K, 'u:' .. counter, num((getnum('u:' .. counter) or 0.0) + amount))
        end
      else
        open = true
      end
    end
  end
  if expired and not open then  -- logic.settle: nothing in flight holds anything
    for _, field in ipairs(fields) do
      if string.sub(field, 1, 2) == 'r:' then redis.call('HSET', K, field, num(0.0)) end
    end
  end
end
local claims = {}
for _, c in ipairs(A[5]) do
  claims[#claims + 1] = {counter = c[1], fixed = c[2], per_unit = c[3], limit = opt(c[4]), code = c[5]}
end
local function available(c, limit)
  return limit - (getnum('u:' .. c.counter) or 0.0) - (getnum('r:' .. c.counter) or 0.0)
end
local function deny(c)  -- logic._deny
  local left = available(c, c.limit or 0.0)
  local detail = c.counter .. ' limit ' .. fmt(c.limit) .. ' would be exceeded: ' .. fmt(math.max(left, 0.0))
    .. ' left, this step needs at least ' .. fmt(c.fixed + c.per_unit * min_units)
  local code = c.code
  if code == '' then code = c.counter .. '_limit' end
  -- refuse only: a budget claim (sized by the request: another may fit) refuses this request alone
  if A[9] and c.per_unit > 0 then touch(); return cjson.encode({'deny', code, detail, 'held'}) end
  stop(code, detail, now)
  touch()
  return cjson.encode({'deny', code, detail})
end
local units, limiting = max_units, nil
for _, c in ipairs(claims) do
  if c.limit ~= nil then
    local left = available(c, c.limit)
    if c.per_unit > 0 then
      local fit = math.floor((left - c.fixed + EPS) / c.per_unit)
      if fit < units then units, limiting = fit, c end
    elseif c.fixed > left + EPS then
      return deny(c)
    end
  end
end
local function fits_spent(c)  -- logic._fits_spent
  if c.limit == nil then return true end
  return c.limit - (getnum('u:' .. c.counter) or 0.0) - (c.fixed + c.per_unit * min_units) >= -EPS
end
if units < min_units and limiting ~= nil then
  local c = limiting
  local need = c.fixed + c.per_unit * min_units
  for _, other in ipairs(claims) do
    if not fits_spent(other) then return deny(other) end  -- spent: the run stops on that limit
  end
  -- logic._held: only the reservations of steps in flight refuse it
  local open = 0
  for _, field in ipairs(redis.call('HKEYS', K)) do
    if string.sub(field, 1, 2) == 'o:' then open = open + 1 end
  end
  local code = c.code
  if code == '' then code = c.counter .. '_limit' end
  touch()
  return cjson.encode({'deny', code, c.counter .. ' limit ' .. fmt(c.limit) .. ': '
    .. fmt(getnum('r:' .. c.counter) or 0.0) .. ' is held by ' .. open .. ' step(s) in flight and this step'
    .. ' needs at least ' .. fmt(need) .. '; the run goes on: retry once they settle', 'held'})
end
if units < 0 then units = 0 end
if limiting ~= nil and clamp ~= nil and units > clamp then units = clamp end
local amounts, order, output = {}, {}, units
for _, c in ipairs(claims) do
  if amounts[c.counter] == nil then order[#order + 1] = c.counter end
  amounts[c.counter] = c.fixed + c.per_unit * units
  if c.counter == 'tokens' then output = c.per_unit * units end  -- every choice's (logic.reserve)
end
local out = {'ok', redis.call('HGET', K, 'epoch'), string.format('%d', units)}
local held = {}
for _, counter in ipairs(order) do
  local amount = amounts[counter]
  redis.call('HSET', K, 'r:' .. counter, num((getnum('r:' .. counter) or 0.0) + amount))
  held[counter] = num(amount)
  out[#out + 1] = counter
  out[#out + 1] = num(amount)
end
redis.call('HSET', K, 'o:' .. rid, cjson.encode({amounts = held, at = num(now), units = num(units), output = num(output)}),
  'updated_at', num(now))
touch()
return cjson.encode(out)
"""

# A: [epoch|null, reservation id, now, [[counter, amount], ...], tombstone seconds, agent|null]; a null
# epoch matches any (releasing a reservation whose grant was never seen); an agent only when the settling
# store granted the reservation itself. Answers 1 when it settled, 0 when there was nothing to settle.
# Every id settled, released or expired is kept in RELEASED for the tombstone's seconds: a replayed
# settle (its reply was lost) finds it and charges nothing again, and a reserve of it is refused.
_SETTLE = """
local epoch, rid, now, agent = opt(A[1]), A[2], A[3], opt(A[6])
local function bury()
  redis.call('ZADD', RELEASED, num(now), rid)
  redis.call('ZREMRANGEBYSCORE', RELEASED, '-inf', '(' .. num(now - A[5]))
  redis.call('EXPIRE', RELEASED, A[5])
end
local function charge()
  for _, pair in ipairs(A[4]) do
    local field = 'u:' .. pair[1]
    redis.call('HSET', K, field, num((getnum(field) or 0.0) + pair[2]))
  end
  redis.call('HSET', K, 'updated_at', num(now))
  touch()
  bury()
  return 1
end
-- the store granted it, so the run held it: a run without it that never settled it was lost by Redis
-- (FLUSHALL, a restart without its data, eviction) while the step was in flight, and maybe created
-- afresh since. What the provider billed is charged to the run as it is now, never dropped.
local function charge_lost()
  if redis.call('ZSCORE', RELEASED, rid) then return 0 end  -- settled already: its reply was lost
  if redis.call('EXISTS', K) == 0 then
    redis.call('HSET', K, 'run_id', RUN_ID, 'agent', agent, 'epoch', '1', 'status', 'active')
  end
  return charge()
end
if redis.call('EXISTS', K) == 0 then
  if epoch == nil then bury(); return 0 end  -- a release that finds nothing: its reserve may still land
  if agent == nil then return 0 end  -- no run this store knows of: nothing to charge
  return charge_lost()
end
local run_epoch = tonumber(redis.call('HGET', K, 'epoch'))
if epoch ~= nil and run_epoch ~= epoch then
  -- a reset moved the epoch on (the steps in flight then are not charged); a lower one is a run afresh
  if agent ~= nil and run_epoch < epoch then return charge_lost() end
  return 0
end
local held = redis.call('HGET', K, 'o:' .. rid)
if not held then
  if epoch == nil then bury(); return 0 end
  if agent ~= nil then return charge_lost() end
  return 0
end
redis.call('HDEL', K, 'o:' .. rid)
for counter, amount in pairs(cjson.decode(held)['amounts']) do
  local left = (getnum('r:' .. counter) or 0.0) - tonumber(amount)
  if left < 0.0 then left = 0.0 end
  redis.call('HSET', K, 'r:' .. counter, num(left))
end
local fields, open = redis.call('HKEYS', K), false
for _, field in ipairs(fields) do
  if string.sub(field, 1, 2) == 'o:' then open = true break end
end
if not open then  -- logic.settle: nothing in flight holds anything
  for _, field in ipairs(fields) do
    if string.sub(field, 1, 2) == 'r:' then redis.call('HSET', K, field, num(0.0)) end
  end
end
return charge()
"""

# A: [counter, amount, limit|null, code, now]. Answers ["ok"] or ["deny", reason, detail].
_ADD = """
create()
local denied = stopped_denial()
if not denied then denied = add_one(A[1], A[2], opt(A[3]), A[4], A[5]) end
touch()
return cjson.encode(denied or {'ok'})
"""

# A: [list name, keep, [values...]]. Answers the list after the push.
_PUSH = """
create()
local items = push_list(A[1], A[3], A[2])
touch()
return enc_list(items)
"""

# logic.apply. A: [now, [[counter, amount, limit|null, code], ...],
#                   [[list name, keep, [values...], distinct limit (-1: none), code, detail], ...], in flight,
#                   the epoch judged on or -1].
# Answers ["ok"], ["deny", reason, detail] or ["reset", the run's epoch] (`reset_since`: nothing applied).
_APPLY = """
local ended = reset_since(A[5])
if ended then return ended end
create()
local now, adds, pushes, in_flight = A[1], A[2], A[3], A[4]
if #adds > 0 and not in_flight then
  local denied = stopped_denial()
  if denied then touch(); return cjson.encode(denied) end
end
-- a step in flight when its run stopped: only a breach is refused, with the run's own reason
-- every add is judged against the run as it was, before any of them applies
for _, a in ipairs(adds) do
  local limit = opt(a[3])
  if limit ~= nil then
    local current = (getnum('u:' .. a[1]) or 0.0) + (getnum('r:' .. a[1]) or 0.0)
    if current + a[2] > limit + EPS then
      local denied = stopped_denial() or add_one(a[1], a[2], limit, a[4], now)
      touch()
      return cjson.encode(denied)
    end
  end
end
-- logic.repeats: a push that would leave a loop in its list stops the run instead
for _, p in ipairs(pushes) do
  local items = p[4] >= 0 and pushed_list(p[1], p[3], p[2]) or {}
  if #items >= p[2] then
    local seen, distinct = {}, 0
    for _, item in ipairs(items) do
      if not seen[item] then seen[item] = true; distinct = distinct + 1 end
    end
    if distinct <= p[4] then
      local denied = stopped_denial() or {'deny', p[5], p[6]}
      stop(p[5], p[6], now)
      touch()
      return cjson.encode(denied)
    end
  end
end
for _, a in ipairs(adds) do add_one(a[1], a[2], nil, a[4], now) end
for _, p in ipairs(pushes) do push_list(p[1], p[3], p[2]) end
if #pushes > 0 then redis.call('HSET', K, 'updated_at', num(now)) end
touch()
return cjson.encode({'ok'})
"""

# A: [list name, value]. Removes the first occurrence; answers 1 if there was one.
_TAKE = """
if redis.call('EXISTS', K) == 0 then return 0 end
local field, value = 'l:' .. A[1], A[2]
local text = redis.call('HGET', K, field)
if not text then return 0 end
local items = cjson.decode(text)
for i, item in ipairs(items) do
  if item == value then
    table.remove(items, i)
    redis.call('HSET', K, field, enc_list(items))
    touch()
    return 1
  end
end
return 0
"""

# A: [reason, detail, now, the epoch judged on or -1]. Answers the stop the run holds: {'deny', reason,
# detail} (the first stop wins), or ["reset", the run's epoch] (`reset_since`: not stopped).
_STOP = """
local ended = reset_since(A[4])
if ended then return ended end
create()
stop(A[1], A[2], A[3])
touch()
return cjson.encode(stopped_denial())
"""

# A: [step JSON, now, max steps kept, the epoch it ran under or -1]. A step of an ended epoch is left out.
_RECORD_STEP = """
create()
local epoch = tonumber(redis.call('HGET', K, 'epoch'))
if A[4] ~= -1 and epoch ~= A[4] then touch(); return A[4] end
redis.call('RPUSH', STEPS, A[1])
redis.call('LTRIM', STEPS, -A[3], -1)
redis.call('HSET', K, 'updated_at', num(A[2]))
touch()
return epoch
"""

# A: [now]. Answers the fresh run as {"f": [field, value, ...], "s": [], "ended": [segment, start|null],
# "old": {"f": [...], "s": [...]}} (`ended`, `old`: the ended epoch's final root, claimed by the reset, and
# that epoch as it was: `logic.reset`; both absent when the reset claimed no root), or false when there is
# none.
_RESET = """
if redis.call('EXISTS', K) == 0 then return false end
local st = redis.call('HMGET', K, 'run_id', 'agent', 'epoch', 'status')
local claimed = claim_root(tonumber(st[3]), true, st[4] == 'stopped', nil, A[1])
local ended = ''
if claimed then
  ended = ',"ended":' .. claimed .. ',"old":{"f":' .. cjson.encode(redis.call('HGETALL', K)) .. ',"s":['
    .. table.concat(redis.call('LRANGE', STEPS, 0, -1), ',') .. ']}'
end
redis.call('DEL', K, STEPS, KEYS[4], KEYS[5])  -- the former life's tool writes can never be read again
redis.call('HSET', K, 'run_id', st[1], 'agent', st[2], 'epoch', num(tonumber(st[3]) + 1), 'status', 'active',
           'updated_at', num(A[1]))
touch()
return '{"f":' .. cjson.encode(redis.call('HGETALL', K)) .. ',"s":[]' .. ended .. '}'
"""

# A: [epoch, final (bool), stopped (bool), upto|null, now]: `logic.claim_root` (the prelude's `claim_root`).
# Answers [segment, start|null] (JSON) when the caller exports the root, else false. No `touch()`: a claim
# is no activity of the run.
_CLAIM_ROOT = """
if redis.call('EXISTS', K) == 0 then return false end
return claim_root(A[1], A[2], A[3], opt(A[4]), A[5]) or false
"""

# A: [with steps (bool)]. Read-only. Answers {"f": [field, value, ...], "s": [step, ...]} (the steps are
# the JSON texts as recorded, spliced in, not re-encoded), or false when there is no such run.
_GET = """
local fields = redis.call('HGETALL', K)
if #fields == 0 then return false end
local steps = ''
if A[1] then steps = table.concat(redis.call('LRANGE', STEPS, 0, -1), ',') end
return '{"f":' .. cjson.encode(fields) .. ',"s":[' .. steps .. ']}'
"""

BODIES = {
    "reserve": _RESERVE,
    "settle": _SETTLE,
    "add": _ADD,
    "push": _PUSH,
    "apply": _APPLY,
    "take": _TAKE,
    "stop": _STOP,
    "record_step": _RECORD_STEP,
    "reset": _RESET,
    "get": _GET,
    "claim_root": _CLAIM_ROOT,
}
