-- Ring a lane's bell again for the run a worker's wake-up took the bell's member of, if the
-- run still waits: its pop did not take it (it had no slot left, or its queue was paused), and
-- no other worker's pop did meanwhile. A member put back for a run gone would wake workers for
-- nothing, each wake-up putting it back again.
-- KEYS[1] the bell, KEYS[2] the lane's rated set
-- ARGV[1] the bell's member: a rated run's queue member, or a fair run's followed by `|` and
-- its group's key (fair.lua); ARGV[2] its score
-- Returns 1 if the bell rang again, 0 if the run no longer waits.
local bell, member = KEYS[1], ARGV[1]
local set, run = KEYS[2], member
local bar = string.find(member, '|', 1, true)
if bar then
  set, run = string.sub(member, bar + 1), string.sub(member, 1, bar - 1)
end
if redis.call('ZSCORE', set, run) then
  redis.call('ZADD', bell, ARGV[2], member)
  return 1
end
return 0
