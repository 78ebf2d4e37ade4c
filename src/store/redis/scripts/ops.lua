-- One batch of lock operations, run in the order given: acquires, releases, renewals and
-- idempotent completions of the requests that reached one connection together (a lone request
-- is a batch of one). The functions above it do the work; this reads the batch.
--
-- ARGV[1]: '1' with hand-off on, else '0'. ARGV[2]: the claim window in ms. ARGV[3]: the
-- fencing counters' retention in ms. Then each operation: its kind, then its arguments; its keys
-- come next in KEYS, in this order:
--
-- | kind | keys (with hand-off) | arguments |
-- |---|---|---|
-- | `a` acquire | lock, fencing counter (, queue) | token, ttl ms, stamp, channel, rescan |
-- | `r` release | lock (, fencing counter, queue) | token |
-- | `n` renew | lock | token, ttl ms |
-- | `c` complete | lock, record (, fencing counter, queue) | token, record, record ttl ms |
-- | `A` acquire with a share | lock, fencing counter (, queue) | token, weight, capacity, ttl ms, stamp, channel, rescan |
-- | `R` release with a share | lock (, fencing counter, queue) | token, weight, capacity |
-- | `N` renew with a share | lock | token, weight, ttl ms |
--
-- The last three (keys with a capacity, `counted.lua`) run only in the `counted` script, which
-- defines their functions; the plain one reads them but never sends them.
--
-- Returns two values per operation: for an acquire its code and number (see `acquire`), for a
-- complete 0 to 3 (see `complete`), for the others 1 or 0, then 0; for an operation Redis
-- refused (a key of the wrong type, say), -1 and Redis's message. One operation's error does
-- not stop the others, and the fencing counters are saved whatever happened. Every key of one
-- call is in one hash slot on a cluster (the caller groups operations by slot).
local function run(f, ...)
  local ok, code, n = pcall(f, ...)
  if ok then
    return code, n or 0
  end
  return -1, type(code) == 'table' and code.err or tostring(code)
end

local handoff = ARGV[1] == '1'
local claim, retention = ARGV[2], ARGV[3]
local out = {}
local k, a = 1, 4
while a <= #ARGV do
  local kind = ARGV[a]
  local code, n = 0, 0
  if kind == 'a' then
    local lock, fence_key, queue = KEYS[k], KEYS[k + 1], nil
    if handoff then
      queue = KEYS[k + 2]
      k = k + 3
    else
      k = k + 2
    end
    code, n = run(acquire, lock, fence_key, queue, ARGV[a + 1], ARGV[a + 2], retention, claim,
      ARGV[a + 3], ARGV[a + 4], ARGV[a + 5])
    a = a + 6
  elseif kind == 'r' then
    if handoff then
      code, n = run(release, KEYS[k], KEYS[k + 1], KEYS[k + 2], ARGV[a + 1], claim, retention)
      k = k + 3
    else
      code, n = run(release, KEYS[k], nil, nil, ARGV[a + 1], claim, retention)
      k = k + 1
    end
    a = a + 2
  elseif kind == 'n' then
    code, n = run(renew, KEYS[k], ARGV[a + 1], ARGV[a + 2])
    k = k + 1
    a = a + 3
  elseif kind == 'c' then
    if handoff then
      code, n = run(complete, KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], ARGV[a + 1],
        ARGV[a + 2], ARGV[a + 3], claim, retention)
      k = k + 4
    else
      code, n = run(complete, KEYS[k], KEYS[k + 1], nil, nil, ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3], claim, retention)
      k = k + 2
    end
    a = a + 4
  elseif kind == 'A' then
    local lock, fence_key, queue = KEYS[k], KEYS[k + 1], nil
    if handoff then
      queue = KEYS[k + 2]
      k = k + 3
    else
      k = k + 2
    end
    code, n = run(counted_acquire, lock, fence_key, queue, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
      ARGV[a + 4], retention, claim, ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])
    a = a + 8
  elseif kind == 'R' then
    if handoff then
      code, n = run(counted_release, KEYS[k], KEYS[k + 1], KEYS[k + 2], ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3], claim, retention)
      k = k + 3
    else
      code, n = run(counted_release, KEYS[k], nil, nil, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
        claim, retention)
      k = k + 1
    end
    a = a + 4
  elseif kind == 'N' then
    code, n = run(counted_renew, KEYS[k], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
    k = k + 1
    a = a + 4
  else
    save_fences()
    return redis.error_reply('ERR tower-lock: unknown operation ' .. tostring(kind))
  end
  out[#out + 1] = code
  out[#out + 1] = n
end
save_fences()
return out
