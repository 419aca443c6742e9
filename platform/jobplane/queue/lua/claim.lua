-- Promote due delayed runs into the ready set, then pop up to N ready run ids.
-- KEYS[1] ready set, KEYS[2] delayed set
-- ARGV[1] now (epoch ms), ARGV[2] how many to pop, ARGV[3] most delayed runs to promote
-- Returns the popped ids followed by the next delayed due time in ms ("" when none).
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do
  local sep = string.find(member, '|', 1, true)
  local id = string.sub(member, 1, sep - 1)
  local priority = tonumber(string.sub(member, sep + 1))
  redis.call('ZADD', KEYS[1], -priority, id)
  redis.call('ZREM', KEYS[2], member)
end
local result = {}
local n = tonumber(ARGV[2])
if n > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], n)
  for i = 1, #popped, 2 do
    result[#result + 1] = popped[i]
  end
end
local nxt = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
result[#result + 1] = nxt[2] or ''
return result
