-- Shared by the scripts that take or give up a lock: put before their own functions when the
-- scripts are assembled (`OPS_PARTS` and `set_script` in `src/store/redis/scripts.rs`).
--
-- Hand-off queue: with hand-off on, next to each lock key lives its queue,
-- `<prefix>{<tag>}queue:<rest of the lock key>` (`src/store/redis/keys.rs`), a list of
-- waiters, first come first served. An entry is the waiter's token, then a 16-hex-digit stamp
-- (when the waiter registered, on its own clock: a lower bound on when it was queued), then the
-- pub/sub channel of its process. A release gives the key straight to the head of the queue,
-- for a short claim window, and tells it on its channel; the waiter behind it learns that it is
-- next, so that it checks again if the new holder never claims (a hung process). A waiter
-- whose process is gone is skipped: nobody is subscribed to its channel any more.

local STAMP_LEN = 16

-- Gives `lock` to the first waiter in `queue` whose process still listens, for `claim` ms, and
-- tells it (message 'g' token stamp claim ':' fence); tells the two waiters still listening
-- after it that they are next (message 'n' token stamp claim). Entries found dead on the way are
-- dropped. Entries of `skip` are the caller's own: with `mine` (a queued caller that found the
-- key free), reaching one ends the search, since the caller is then first of the live waiters;
-- without it (a releasing holder), they are dropped. Returns 'handed' when handed over, 'mine'
-- when the caller's entry came first, nil when nobody (alive) waits; `lock` is left as it was
-- unless handed over.
local function hand_over(lock, fence_key, queue, claim, retention, skip, mine)
  local toklen = #skip
  while true do
    local head = redis.call('LPOP', queue)
    if not head then
      return nil
    end
    local tok = string.sub(head, 1, toklen)
    if tok == skip then
      if mine then
        return 'mine'
      end
    else
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
        -- The next two waiters still listening check again after the claim window if the new
        -- holder never claims (a hung process); two, so that the queue moves on even when the
        -- next one hangs too. Told by PUBLISH, whose answer is free here: nobody heard it, so
        -- that process is gone too; a dead entry at the head is dropped, one further back is
        -- passed over (a pattern subscriber hides a dead one here; that costs a waiter behind
        -- it its timer).
        local i, told = 0, 0
        while told < 2 do
          local after = redis.call('LINDEX', queue, i)
          if not after then
            break
          end
          local heard = redis.call('PUBLISH', string.sub(after, toklen + STAMP_LEN + 1),
            'n' .. string.sub(after, 1, toklen + STAMP_LEN) .. claim)
          if heard > 0 then
            told = told + 1
            i = i + 1
          elseif i == 0 then
            redis.call('LPOP', queue)
          else
            i = i + 1
          end
        end
        return 'handed'
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
  if not (queue and hand_over(lock, fence_key, queue, claim, retention, token, false)) then
    redis.call('DEL', lock)
  end
end

