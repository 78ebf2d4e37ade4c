-- Extends a lock to `ttl` ms, only for its holder `token`.
-- Returns 1 when extended, 0 when the lock is not held with this token.
local function renew(lock, token, ttl)
  if redis.call('GET', lock) == token then
    return redis.call('PEXPIRE', lock, ttl)
  end
  return 0
end

