-- Fenced writes: a batch of reads and writes of the data kept next to the locks, applied in one
-- step only if every resource's fence allows it (see `crate::fence`).
--
-- KEYS: the fence keys of the batch's resources (`n` of them), then the data key of each
-- operation, in order. ARGV[1]: `n`. ARGV[2]: the horizon in µs: a resource without a fence
-- refuses a token older than that (tokens follow the lock server's clock, in µs). ARGV[3]: how
-- long a fence is kept after this batch, in ms (the horizon and some slack). ARGV[4 .. n + 3]:
-- the fencing token that guards each resource, in decimal. Then each operation: its kind, then
-- its arguments.
--
-- | kind | operation | arguments | reply |
-- |---|---|---|---|
-- | `g` | GET | | the value, or nil |
-- | `hg` | HGET | field | the value, or nil |
-- | `s` | SET | value | 'OK' |
-- | `sx` | SET PX | value, ttl ms | 'OK' |
-- | `d` | DEL | | keys removed |
-- | `hs` | HSET | field, value | fields added |
-- | `i` | INCRBY | delta | the counter after it |
-- | `p` | RPUSH | value | the list's length after it |
--
-- Returns {1, reply, ...} when applied; {0, i, fence} when resource i's fence is above its
-- token, or it has none and its token is older than the horizon (`fence` is then the oldest
-- token it admits); {-1, i, reason} when operation i cannot apply (a key of another type, a counter that is
-- not a whole number or would overflow). Nothing is changed unless it answers 1: every check
-- runs before the first write, since a script that fails half way keeps what it wrote.
-- A resource's fence is raised to its token when the batch writes, when it has a fence
-- already, or when a read found something; a batch that only reads what does not exist leaves
-- nothing behind. A fence so written expires ARGV[3] ms after this batch, or when it would
-- have anyway, or when the longest-lived value the batch sets does, whichever is last: no
-- fence goes before the data it guards.

-- Whether `a` is below `b`, both decimal digits without leading zeros (exact for every u64,
-- which Lua's numbers are not).
local function below(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end

local n = tonumber(ARGV[1])
local keep = tonumber(ARGV[3])
-- The oldest token a resource without a fence admits: now less the horizon, read once.
local oldest
local function horizon()
  if not oldest then
    local now = redis.call('TIME')
    local floor = tonumber(now[1]) * 1000000 + tonumber(now[2]) - tonumber(ARGV[2])
    oldest = string.format('%.0f', math.max(floor, 0))
  end
  return oldest
end
local fences = {}
for i = 1, n do
  local token = ARGV[3 + i]
  local fence = redis.call('GET', KEYS[i])
  if fence then
    if below(token, fence) then
      return {0, i, fence}
    end
  elseif below(token, horizon()) then
    return {0, i, horizon()}
  end
  fences[i] = fence
end

-- Every operation's key and arguments, and what each would find: no write happens before
-- all of them are known to apply.
local ops = {}
local planned = {}
local writes = false
local a = n + 4
local k = n + 1
while a <= #ARGV do
  local kind = ARGV[a]
  local arity = ({g = 0, hg = 1, s = 1, sx = 2, d = 0, hs = 2, i = 1, p = 1})[kind]
  if arity == nil then
    return redis.error_reply('ERR tower-lock: unknown fenced operation ' .. tostring(kind))
  end
  local op = {kind = kind, key = KEYS[k], args = {}}
  for j = 1, arity do
    op.args[j] = ARGV[a + j]
  end
  ops[#ops + 1] = op
  a = a + 1 + arity
  k = k + 1
end

for i, op in ipairs(ops) do
  local state = planned[op.key]
  if state == nil then
    local t = redis.call('TYPE', op.key)['ok']
    state = {t = t}
    planned[op.key] = state
  end
  local t = state.t
  local kind = op.kind
  local function refuse(reason)
    return {-1, i, reason}
  end
  if kind == 'g' then
    if t ~= 'string' and t ~= 'none' then
      return refuse('GET of a key that holds a ' .. t)
    end
  elseif kind == 'hg' or kind == 'hs' then
    if t ~= 'hash' and t ~= 'none' then
      return refuse('a hash operation on a key that holds a ' .. t)
    end
    if kind == 'hs' then
      state.t = 'hash'
      writes = true
    end
  elseif kind == 's' or kind == 'sx' then
    state.t = 'string'
    state.v = op.args[1]
    state.known = true
    writes = true
    if kind == 'sx' and tonumber(op.args[2]) > keep then
      keep = tonumber(op.args[2])
    end
  elseif kind == 'd' then
    state.t = 'none'
    state.v = nil
    state.known = true
    writes = true
  elseif kind == 'i' then
    if t ~= 'string' and t ~= 'none' then
      return refuse('INCRBY of a key that holds a ' .. t)
    end
    local v = state.v
    if not state.known then
      v = redis.call('GET', op.key)
    end
    v = v or '0'
    -- As strict as INCRBY itself (no sign but '-', no leading zero, no '-0'), and within a
    -- range where Lua's numbers are exact enough: a value INCRBY would refuse must be refused
    -- here, before anything is written, or the batch would stop half applied.
    if type(v) == 'string' and not (v == '0' or string.match(v, '^%-?[1-9]%d*$')) then
      return refuse('INCRBY of a value that is not a whole number')
    end
    local sum = tonumber(v) + tonumber(op.args[1])
    if math.abs(tonumber(v)) >= 9.2e18 or sum >= 9.2e18 or sum <= -9.2e18 then
      return refuse('INCRBY would overflow')
    end
    state.t = 'string'
    state.v = sum
    state.known = true
    writes = true
  elseif kind == 'p' then
    if t ~= 'list' and t ~= 'none' then
      return refuse('RPUSH to a key that holds a ' .. t)
    end
    state.t = 'list'
    writes = true
  end
end

local out = {1}
local found = false
for _, op in ipairs(ops) do
  local kind, key, args = op.kind, op.key, op.args
  local reply
  if kind == 'g' then
    reply = redis.call('GET', key)
    found = found or reply ~= false
  elseif kind == 'hg' then
    reply = redis.call('HGET', key, args[1])
    found = found or reply ~= false
  elseif kind == 's' then
    redis.call('SET', key, args[1])
    reply = 'OK'
  elseif kind == 'sx' then
    redis.call('SET', key, args[1], 'PX', args[2])
    reply = 'OK'
  elseif kind == 'd' then
    reply = redis.call('DEL', key)
  elseif kind == 'hs' then
    reply = redis.call('HSET', key, args[1], args[2])
  elseif kind == 'i' then
    reply = redis.call('INCRBY', key, args[1])
  elseif kind == 'p' then
    reply = redis.call('RPUSH', key, args[1])
  end
  out[#out + 1] = reply
end

for i = 1, n do
  local token, fence = ARGV[3 + i], fences[i]
  if writes or found or fence then
    -- Kept for the horizon after this batch, and never less than it had left (a fence written
    -- before fences expired has no expiry, -1: it gets one now).
    local ttl = keep
    if fence then
      ttl = math.max(ttl, redis.call('PTTL', KEYS[i]))
    end
    redis.call('SET', KEYS[i], token, 'PX', string.format('%d', ttl))
  end
end
return out
