-- Let go of locks the owner holds, and take the run that waited longest for each lock let go.
-- KEYS the locks, then (resource locks) each lock's waiters, in the same order; ARGV[1] owner,
-- ARGV[2] 1 when the waiters are given
-- Returns how many locks the owner held, then the waiters taken (their members).
local waiters = ARGV[2] == '1'
local locks = waiters and #KEYS / 2 or #KEYS
local result = {0}
for i = 1, locks do
  local value = redis.call('GET', KEYS[i])
  if value then
    local cut = string.find(value, '\n', 1, true)
    if (cut and string.sub(value, 1, cut - 1) or value) == ARGV[1] then
      redis.call('DEL', KEYS[i])
      result[1] = result[1] + 1
      if waiters then
        local first = redis.call('ZPOPMIN', KEYS[locks + i])
        if first[1] then result[#result + 1] = first[1] end
      end
    end
  end
end
return result
