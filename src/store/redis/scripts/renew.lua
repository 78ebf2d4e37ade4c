-- Extend a lock, only for its holder.
-- KEYS[1]: the lock key. ARGV[1]: the holder's token. ARGV[2]: new time to live in ms.
-- Returns 1 when extended, 0 when the lock is not held with this token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
