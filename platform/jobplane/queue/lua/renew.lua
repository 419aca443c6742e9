-- Extend locks the owner still holds; a lock it lost (expired, taken by another, wiped) is not
-- taken again. KEYS the locks; ARGV[1] owner, ARGV[2] ttl ms
-- Returns 1 for each lock extended, 0 for each lost, in order.
local result = {}
for i = 1, #KEYS do
  local value = redis.call('GET', KEYS[i])
  local cut = value and string.find(value, '\n', 1, true)
  if value and (cut and string.sub(value, 1, cut - 1) or value) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
