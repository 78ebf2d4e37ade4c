-- Shared by the scripts that take a lock: prepended to each of them.

-- A new fencing token for a lock: the counter of the lock key's hash slot plus one. `fence_key`
-- is shared by every lock key in that slot, so tokens increase across all of them and no key is
-- left behind per lock key. A missing counter (new, expired `retention` ms after it was
-- created, or lost with a restart) starts again from the server time in microseconds, which is
-- ahead of the old counter unless the slot handed out a million tokens a second: tokens stay
-- increasing as long as the server clock does not step back by more than the retention.
local function new_fence(fence_key, retention)
  local fence = redis.call('INCR', fence_key)
  if fence == 1 then
    local now = redis.call('TIME')
    fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', fence_key, string.format('%d', fence), 'PX', retention)
  end
  return fence
end
