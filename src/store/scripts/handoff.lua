-- Shared by the scripts that take or give up a lock: inserted at their `-- @handoff` line, after
-- their fast path, so that the usual (uncontended) call does not define these functions.
--
-- Hand-off queue: with hand-off on, next to each lock key lives `<lock key>:queue`, a list of
-- waiters, first come first served. An entry is the waiter's token, then a 16-hex-digit stamp
-- (when the waiter registered, on its own clock: a lower bound on when it was queued), then the
-- pub/sub channel of its process. A release gives the key straight to the head of the queue,
-- for a short claim window, and tells it on its channel; the waiter behind it learns that it is
-- next, so that it checks again if the new holder never claims (a hung process). A waiter
-- whose process is gone is skipped: nobody is subscribed to its channel any more.

local STAMP_LEN = 16

-- Gives `lock` to the first waiter in `queue` whose token is not `skip` and whose process still
-- listens, for `claim` ms, and tells it (message 'g' token stamp claim ':' fence); tells the
-- waiter after it that it is next (message 'n' token stamp claim). Returns true when handed
-- over, false when nobody (alive) waits; `lock` is then left as it was.
local function hand_over(lock, fence_key, queue, claim, retention, skip)
  local toklen = #skip
  while true do
    local head = redis.call('LPOP', queue)
    if not head then
      return false
    end
    local tok = string.sub(head, 1, toklen)
    if tok ~= skip then
      local channel = string.sub(head, toklen + STAMP_LEN + 1)
      -- Somebody listens on the waiter's channel: its process is alive. None: the process is
      -- gone (its subscription closed with it), so the next waiter is served now rather than
      -- after a claim window nobody would use. NUMSUB counts channel subscribers only, so a
      -- pattern subscriber (a debugging `PSUBSCRIBE *`) does not pass for the waiter.
      if redis.call('PUBSUB', 'NUMSUB', channel)[2] > 0 then
        local fence = new_fence(fence_key, retention)
        local id = string.sub(head, 1, toklen + STAMP_LEN)
        redis.call('PUBLISH', channel, 'g' .. id .. claim .. ':' .. string.format('%d', fence))
        redis.call('SET', lock, tok, 'PX', claim)
        local after = redis.call('LINDEX', queue, 0)
        if after then
          redis.call('PUBLISH', string.sub(after, toklen + STAMP_LEN + 1),
            'n' .. string.sub(after, 1, toklen + STAMP_LEN) .. claim)
        end
        return true
      end
    end
  end
end

-- Takes every entry of `token` out of `queue` (a waiter that gives up).
local function leave(queue, token)
  local toklen = #token
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if string.sub(entry, 1, toklen) == token then
      redis.call('LREM', queue, 0, entry)
    end
  end
end

-- Releases `lock` held by `token`: hands it to the next waiter, or deletes it. Without a queue
-- (hand-off off), deletes it.
local function let_go(lock, fence_key, queue, claim, retention, token)
  if not (queue and hand_over(lock, fence_key, queue, claim, retention, token)) then
    redis.call('DEL', lock)
  end
end

