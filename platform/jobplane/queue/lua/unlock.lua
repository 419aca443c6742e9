-- Let go of locks the owner holds. KEYS the locks; ARGV[1] owner
-- Returns how many it held.
local released = 0
for i = 1, #KEYS do
  local value = redis.call('GET', KEYS[i])
  if value then
    local cut = string.find(value, '\n', 1, true)
    if (cut and string.sub(value, 1, cut - 1) or value) == ARGV[1] then
      redis.call('DEL', KEYS[i])
      released = released + 1
    end
  end
end
return released
