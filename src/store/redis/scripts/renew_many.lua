-- Extend several locks at once, each only for its holder.
-- KEYS[i]: a lock key. ARGV[1]: new time to live in ms. ARGV[i + 1]: the holder's token for KEYS[i].
-- Returns, for each key, 1 when extended and 0 when it is not held with its token.
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    out[i] = redis.call('PEXPIRE', key, ARGV[1])
  else
    out[i] = 0
  end
end
return out
