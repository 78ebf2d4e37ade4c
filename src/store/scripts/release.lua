-- Delete a lock, only for its holder, and announce it if someone waits.
-- KEYS[1]: the lock key. KEYS[2], only when releases are announced: its "someone waits" marker.
-- ARGV[1]: the holder's token. ARGV[2]: the channel to announce on ('' for none).
-- Returns 1 when deleted, 0 when the lock is not held with this token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] and redis.call('DEL', KEYS[2]) == 1 and ARGV[2] ~= '' then
    redis.call('PUBLISH', ARGV[2], KEYS[1])
  end
  return 1
end
return 0
