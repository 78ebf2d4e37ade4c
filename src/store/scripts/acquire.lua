-- Take a lock if it is free, and hand out a fencing token.
-- KEYS[1]: the lock key. KEYS[2]: its fencing counter. KEYS[3], only when releases are
-- announced: its "someone waits" marker.
-- ARGV[1]: the holder's token. ARGV[2]: time to live in ms. ARGV[3]: counter retention in ms.
-- ARGV[4]: '1' to leave the marker when the lock is held, so that its release is announced.
-- Returns {1, fencing token} when acquired, {0, remaining ttl in ms} when held by someone else.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- The token is max(last + 1, server time in microseconds): strictly increasing per key even
  -- after the counter key expires, as long as the server clock does not step back further than
  -- the counter's retention.
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  local fence = math.max(last + 1, micros)
  redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[3])
  return {1, fence}
end
local pttl = redis.call('PTTL', KEYS[1])
if KEYS[3] and ARGV[4] == '1' and pttl > 0 then
  -- Lives as long as the holder's lease (plus a margin): a waiter retries by then anyway.
  redis.call('SET', KEYS[3], '1', 'PX', pttl + 1000)
end
return {0, pttl}
