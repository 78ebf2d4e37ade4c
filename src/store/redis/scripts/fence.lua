-- Fencing tokens, for the functions that take or hand over a lock.
--
-- A new fencing token for a lock is max(last + 1, server time in microseconds). `fence_key` is
-- the counter of the lock key's hash slot, shared by every lock key in that slot, so tokens
-- increase across all of them and no key is left behind per lock key. They stay increasing
-- after the counter expires, as long as the server clock does not step back further than the
-- counter's retention. Within one script run (a batch), TIME is read once, each counter read
-- once, and each counter written once, at the end (`save_fences`): a batch costs one TIME and
-- one counter update per counter it uses, however many locks it takes.
local fence_now
local fence_last = {}
local fence_keep = {}

local function new_fence(fence_key, retention)
  if not fence_now then
    local now = redis.call('TIME')
    fence_now = tonumber(now[1]) * 1000000 + tonumber(now[2])
  end
  local last = fence_last[fence_key]
  if not last then
    last = tonumber(redis.call('GET', fence_key) or '0') or 0
  end
  local fence = math.max(last + 1, fence_now)
  fence_last[fence_key] = fence
  fence_keep[fence_key] = retention
  return fence
end

-- Writes every counter this run used (with its retention).
local function save_fences()
  for fence_key, retention in pairs(fence_keep) do
    redis.call('SET', fence_key, string.format('%d', fence_last[fence_key]), 'PX', retention)
  end
end

