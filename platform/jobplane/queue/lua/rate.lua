-- Prepended to pop.lua: a run's start under its rate limit, taken in the script that pops the
-- run, so that a run over its window goes straight back to its delayed set.
--
-- A window's starts: a sorted set (member the run id, score when it started, epoch ms), under
-- `<rates><first 24 hex digits of the window's SHA-1>` (`Keys.rate`), and beside it, `:next`
-- appended, the latest time a refused run was told to come back.

-- The rate window a queue member (`<id>[+<limits as JSON>]`, `QueueEntry.member`) must pass:
-- {run id, window, limit, period in ms}, or nil when it has none.
local function window_of(member)
  local plus = string.find(member, '+', 1, true)
  if not plus then return nil end
  local limits = cjson.decode(string.sub(member, plus + 1))
  if type(limits[3]) ~= 'string' then return nil end
  local period = math.floor(tonumber(limits[5]) * 1000)
  return {string.sub(member, 1, plus - 1), limits[3], tonumber(limits[4]), period}
end

-- At most `limit` starts in any `period` ms of the window. Returns 0 when the run may start
-- now (its start is recorded now), -1 when it may start and its start was recorded before (a
-- stale pop of a run started since: the caller must not take that start back), or the epoch
-- ms it should try again at: the next free moment of the window, each refused run a share of
-- the period after the one before it, so that a backlog comes back spread at the limit's pace
-- rather than all at once (and would mostly be refused again).
local function window_take(rates, now, window, limit, period, id)
  local starts = rates .. string.sub(redis.sha1hex(window), 1, 24)
  local hint = starts .. ':next'
  redis.call('ZREMRANGEBYSCORE', starts, '-inf', now - period)
  if redis.call('ZSCORE', starts, id) then
    return -1
  end
  local count = redis.call('ZCARD', starts)
  if count < limit then
    redis.call('ZADD', starts, now, id)
    redis.call('PEXPIRE', starts, period)
    return 0
  end
  -- The start that leaves the window first, making room for one more.
  local leaving = redis.call('ZRANGE', starts, count - limit, count - limit, 'WITHSCORES')
  local at = tonumber(leaving[2]) + period
  local promised = tonumber(redis.call('GET', hint) or '0')
  at = math.floor(math.max(at, promised + period / limit))
  redis.call('SET', hint, at, 'PX', math.ceil(at - now + period))
  return at
end
