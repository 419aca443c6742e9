-- Prepended to the scripts that put runs into fair lanes (pop.lua promotes, enter.lua pushes),
-- so that how a run enters one is written once.
--
-- A fair lane (`fairness: round_robin`) keeps a sorted set of run ids per group (a scope and
-- scope id), scored -priority like a plain ready set, and a ring of its groups. A group's
-- score in the ring is its first run's priority class (100 - priority, best first) times
-- TURN, plus the turn it last joined in (a counter shared by every ring): groups of one
-- class take turns, and a group that was just served goes to the back of its class. Every
-- ready run of the lane is also in its bell, which a worker blocked in BZPOPMIN waits on, as
-- `<member>|<group key>`: a worker woken by it can tell whether the run still waits
-- (ring.lua).
local TURN = 1099511627776 -- 2^40: a million turns a second for 34 years before classes mix

local function ring_score(turn_key, priority)
  return (100 - priority) * TURN + redis.call('INCR', turn_key)
end

-- A fair run's member in its lane's bell (`bell_member` in queue/keys.py).
local function rung(id, group)
  return id .. '|' .. group
end

-- A ready run enters its group; the group joins the ring, or moves up to the run's class.
local function enter(ring, group, bell, turn_key, id, priority)
  redis.call('ZADD', group, -priority, id)
  redis.call('ZADD', ring, 'LT', ring_score(turn_key, priority), group)
  redis.call('ZADD', bell, -priority, rung(id, group))
end
