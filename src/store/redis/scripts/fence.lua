-- Shared by the scripts that take a lock: prepended to each of them.

-- A new fencing token for a lock: max(last + 1, server time in microseconds). `fence_key` is
-- the counter of the lock key's hash slot, shared by every lock key in that slot, so tokens
-- increase across all of them and no key is left behind per lock key. They stay increasing
-- after the counter expires, as long as the server clock does not step back further than the
-- counter's retention.
local function new_fence(fence_key, retention)
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('GET', fence_key) or '0') or 0
  local fence = math.max(last + 1, micros)
  redis.call('SET', fence_key, string.format('%d', fence), 'PX', retention)
  return fence
end

