-- Delete a lock, only for its holder.
-- KEYS[1]: the lock key. ARGV[1]: the holder's token.
-- Returns 1 when deleted, 0 when the lock is not held with this token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
