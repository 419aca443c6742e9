-- Prepended to pop.lua: a run's start under its rate limit, taken in the script that pops the
-- run, so that a run over its window goes straight back to its delayed set.
--
-- A window's starts: a sorted set (member the run id, score when it started, epoch ms), under
-- `<rates><first 24 hex digits of the window's SHA-1>` (`Keys.rate`), and beside it, `:next`
-- appended, the latest time a refused run was told to come back.
--
-- A pop takes many runs of one template at once under a backlog, and they share a window: what
-- a pop learns of a window (its members' limits decoded, its key, how many starts it holds) is
-- kept for the rest of the script, so each further run of the window costs two commands.

-- The decoded limits of each member suffix seen in this script.
local limits_of = {}

-- The rate window a queue member (`<id>[+<limits as JSON>]`, `QueueEntry.member`) must pass:
-- {run id, window, limit, period in ms}, or nil when it has none.
local function window_of(member)
  local plus = string.find(member, '+', 1, true)
  if not plus then return nil end
  local suffix = string.sub(member, plus + 1)
  local rate = limits_of[suffix]
  if rate == nil then
    local limits = cjson.decode(suffix)
    rate = false
    if type(limits[3]) == 'string' then
      rate = {limits[3], tonumber(limits[4]), math.floor(tonumber(limits[5]) * 1000)}
    end
    limits_of[suffix] = rate
  end
  if not rate then return nil end
  return {string.sub(member, 1, plus - 1), rate[1], rate[2], rate[3]}
end

-- Each window met in this script: {starts key, hint key, starts it holds, promised time or
-- nil, the period they were counted over}.
local windows_met = {}

-- The window's starts within `period` ms of `now`, counted once per script: the older ones are
-- dropped as it is first met (and again should a run of another template version give the
-- window another period).
local function window_met(rates, now, window, period)
  local met = windows_met[window]
  if met == nil then
    local starts = rates .. string.sub(redis.sha1hex(window), 1, 24)
    met = {starts, starts .. ':next', 0, nil, nil}
    windows_met[window] = met
  end
  if met[5] ~= period then
    redis.call('ZREMRANGEBYSCORE', met[1], '-inf', now - period)
    met[3], met[5] = redis.call('ZCARD', met[1]), period
  end
  return met
end

-- At most `limit` starts in any `period` ms of the window. Returns 0 when the run may start
-- now (its start is recorded now), -1 when it may start and its start was recorded before (a
-- stale pop of a run started since: the caller must not take that start back), or the epoch
-- ms it should try again at: the next free moment of the window, each refused run a share of
-- the period after the one before it, so that a backlog comes back spread at the limit's pace
-- rather than all at once (and would mostly be refused again).
local function window_take(rates, now, window, limit, period, id)
  local met = window_met(rates, now, window, period)
  local starts, hint, count = met[1], met[2], met[3]
  if redis.call('ZSCORE', starts, id) then
    return -1
  end
  if count < limit then
    redis.call('ZADD', starts, now, id)
    redis.call('PEXPIRE', starts, period)
    met[3] = count + 1
    return 0
  end
  -- The start that leaves the window first, making room for one more.
  local leaving = redis.call('ZRANGE', starts, count - limit, count - limit, 'WITHSCORES')
  local at = tonumber(leaving[2]) + period
  local promised = met[4] or tonumber(redis.call('GET', hint) or '0')
  at = math.floor(math.max(at, promised + period / limit))
  redis.call('SET', hint, at, 'PX', math.ceil(at - now + period))
  met[4] = at
  return at
end
