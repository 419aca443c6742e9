-- A start under a rate limit: at most ARGV[2] starts in any ARGV[3] ms of one window.
-- KEYS[1] the window's starts (sorted set: member the run id, score when it started, epoch
-- ms), KEYS[2] the latest time a refused run was told to come back
-- ARGV[1] now (epoch ms), ARGV[2] limit, ARGV[3] period (ms), ARGV[4] the run id
-- Returns 0 when the run may start now (its start is recorded now), -1 when it may start and
-- its start was recorded before (a claim repeated, or a stale pop of a run started since: the
-- caller must not take that start back), or the epoch ms it should try again at: the next free moment of the window, each refused run a share of the period after
-- the one before it, so that a backlog comes back spread at the limit's pace rather than all
-- at once (and would mostly be refused again).
local now, limit, period = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - period)
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then
  return -1
end
local count = redis.call('ZCARD', KEYS[1])
if count < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], period)
  return 0
end
-- The start that leaves the window first, making room for one more.
local leaving = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
local at = tonumber(leaving[2]) + period
local promised = tonumber(redis.call('GET', KEYS[2]) or '0')
at = math.floor(math.max(at, promised + period / limit))
redis.call('SET', KEYS[2], at, 'PX', math.ceil(at - now + period))
return at
