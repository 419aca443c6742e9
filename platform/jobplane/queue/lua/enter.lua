-- Push ready runs into fair lanes (fair.lua, prepended, says how a run enters one).
-- KEYS[1] the ring turn counter, then per run its lane's ring, its group and its lane's bell
-- ARGV per run: its id, its priority
local j = 1
for i = 2, #KEYS, 3 do
  enter(KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[1], ARGV[j], tonumber(ARGV[j + 1]))
  j = j + 2
end
return 1
