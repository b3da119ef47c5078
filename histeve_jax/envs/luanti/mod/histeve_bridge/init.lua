-- histeve_bridge: the privileged side of histeve_jax's Luanti backend.
--
-- Every server step it writes the player's state as JSON to <world>/histeve_state.json (written to a
-- temporary file and renamed, so the reader never sees half a file), and it runs the reset commands that
-- the Python env writes to <world>/histeve_cmd.json (also written by rename; removed here once read).
-- Event counters mirror MineStudio's info keys: mine_block, craft_item, pickup, place_block, use_item.

local worldpath = minetest.get_worldpath()
local STATE = worldpath .. "/histeve_state.json"
local STATE_TMP = STATE .. ".tmp"
local CMD = worldpath .. "/histeve_cmd.json"

local tick = 0
local events
local gui_quits = 0          -- inventory formspec closes reported by the client ("quit" fields)
local last_formname = ""
local acked_cmd = -1         -- id of the last command list fully executed
local pending = nil          -- {id=, ops=, i=, waiting=} while a command list runs
local watch_names = {}
local watch_radius = 8
local watch_min_y = nil      -- nodes below this y are not reported (the arena's buried layers)
local watch_bound = nil      -- nodes with |x| or |z| above this are not reported (outside the arena)
local nearby = {}
local errors = {}

local function reset_events()
	events = {mine_block = {}, craft_item = {}, pickup = {}, place_block = {}, use_item = {}}
end
reset_events()

local function bump(kind, name, n)
	if not name or name == "" then return end
	local t = events[kind]
	t[name] = (t[name] or 0) + (n or 1)
end

local function the_player()
	return minetest.get_connected_players()[1]
end

-- World: one temperate grassland biome with sparse apple trees, so every seed looks alike around the
-- arena (the arena itself is rebuilt by commands at each reset).
minetest.clear_registered_decorations()
minetest.clear_registered_biomes()
minetest.register_biome({
	name = "histeve_grassland",
	node_top = "default:dirt_with_grass", depth_top = 1,
	node_filler = "default:dirt", depth_filler = 3,
	node_riverbed = "default:sand", depth_riverbed = 2,
	y_max = 31000, y_min = -31000,
	heat_point = 50, humidity_point = 50,
})
minetest.register_decoration({
	name = "histeve_bridge:apple_tree",
	deco_type = "schematic",
	place_on = {"default:dirt_with_grass"},
	sidelen = 16,
	fill_ratio = 0.004,
	biomes = {"histeve_grassland"},
	y_max = 31000, y_min = 1,
	schematic = minetest.get_modpath("default") .. "/schematics/apple_tree.mts",
	flags = "place_center_x, place_center_z",
	rotation = "0",
})

-- Nine hotbar slots as in Minecraft (hotbar.1 .. hotbar.9); after default's own join callback sets 8.
minetest.register_on_joinplayer(function(player)
	local name = player:get_player_name()
	minetest.after(0.2, function()
		local p = minetest.get_player_by_name(name)
		if p then
			p:hud_set_hotbar_itemcount(9)
			-- minetest_game's hotbar image has 8 frames; without an image each slot gets its own frame.
			p:hud_set_hotbar_image("")
		end
	end)
end)

-- Event hooks ----------------------------------------------------------------------------------------

minetest.register_on_dignode(function(pos, oldnode, digger)
	if digger and digger:is_player() then
		bump("mine_block", oldnode.name)
		local tool = digger:get_wielded_item():get_name()
		-- Minecraft counts a tool as used each time it breaks a block.
		if tool ~= "" and minetest.registered_tools[tool] then bump("use_item", tool) end
	end
end)

minetest.register_on_placenode(function(pos, newnode, placer, oldnode, itemstack)
	if placer and placer:is_player() then
		bump("place_block", newnode.name)
		bump("use_item", itemstack and itemstack:get_name() or newnode.name)
	end
end)

minetest.register_on_craft(function(itemstack, player)
	if player and player:is_player() then bump("craft_item", itemstack:get_name(), itemstack:get_count()) end
end)

minetest.register_on_item_eat(function(hp_change, replace_with_item, itemstack, user)
	if user and user:is_player() then bump("use_item", itemstack:get_name()) end
end)

-- Drops from digging go straight into the inventory in Luanti; Minecraft picks them up as item entities,
-- so count what reaches the digger's inventory as "pickup".
local builtin_handle_node_drops = minetest.handle_node_drops
minetest.handle_node_drops = function(pos, drops, digger)
	if digger and digger:is_player() then
		local inv = digger:get_inventory()
		local before = {}
		for _, item in pairs(drops) do
			local name = ItemStack(item):get_name()
			before[name] = true
		end
		local counts = {}
		for _, st in ipairs(inv:get_list("main")) do
			if before[st:get_name()] then counts[st:get_name()] = (counts[st:get_name()] or 0) + st:get_count() end
		end
		builtin_handle_node_drops(pos, drops, digger)
		for _, st in ipairs(inv:get_list("main")) do
			local name = st:get_name()
			if before[name] then counts[name] = (counts[name] or 0) - st:get_count() end
		end
		for name, c in pairs(counts) do
			if c < 0 then bump("pickup", name, -c) end
		end
		return
	end
	return builtin_handle_node_drops(pos, drops, digger)
end

local item_ent = minetest.registered_entities["__builtin:item"]
local builtin_item_punch = item_ent.on_punch
item_ent.on_punch = function(self, hitter)
	local stack = ItemStack(self.itemstring)
	local inv = hitter and hitter:is_player() and hitter:get_inventory()
	local had = 0
	if inv then
		for _, st in ipairs(inv:get_list("main")) do
			if st:get_name() == stack:get_name() then had = had + st:get_count() end
		end
	end
	builtin_item_punch(self, hitter)
	if inv then
		local now = 0
		for _, st in ipairs(inv:get_list("main")) do
			if st:get_name() == stack:get_name() then now = now + st:get_count() end
		end
		if now > had then bump("pickup", stack:get_name(), now - had) end
	end
end

-- Taking smelted items out of a furnace counts as crafting them (as Minecraft's statistics do).
for _, fname in ipairs({"default:furnace", "default:furnace_active"}) do
	local def = minetest.registered_nodes[fname]
	if def then
		local old_take = def.on_metadata_inventory_take
		minetest.override_item(fname, {
			on_metadata_inventory_take = function(pos, listname, index, stack, player)
				if listname == "dst" and player and player:is_player() then
					bump("craft_item", stack:get_name(), stack:get_count())
				end
				if old_take then return old_take(pos, listname, index, stack, player) end
			end,
		})
	end
end

-- Closing the inventory puts what is left in the crafting grid back into the main inventory, as Minecraft
-- does (minetest_game keeps it in the grid): a craft cut short leaves its items in the inventory, and the
-- next craft opens on an empty grid, as every demonstration does. What does not fit is dropped at the feet.
local function return_craft_grid(player)
	local inv = player:get_inventory()
	for i, stack in ipairs(inv:get_list("craft") or {}) do
		if not stack:is_empty() then
			inv:set_stack("craft", i, ItemStack(""))
			local left = inv:add_item("main", stack)
			if not left:is_empty() then minetest.add_item(player:get_pos(), left) end
		end
	end
end

minetest.register_on_player_receive_fields(function(player, formname, fields)
	last_formname = formname
	if fields.quit then
		gui_quits = gui_quits + 1
		if formname == "" then return_craft_grid(player) end  -- the player's own inventory
	end
end)

-- Commands --------------------------------------------------------------------------------------------

local function vec(t) return {x = t[1], y = t[2], z = t[3]} end

local function sorted_box(a, b)
	return {x = math.min(a.x, b.x), y = math.min(a.y, b.y), z = math.min(a.z, b.z)},
		{x = math.max(a.x, b.x), y = math.max(a.y, b.y), z = math.max(a.z, b.z)}
end

-- Fill a box with one node through a VoxelManip (fast for whole arenas), param2 = 0, metadata cleared.
local function fill(p1, p2, name)
	p1, p2 = sorted_box(p1, p2)
	for _, p in ipairs(minetest.find_nodes_with_meta(p1, p2)) do minetest.get_meta(p):from_table(nil) end
	local vm = minetest.get_voxel_manip()
	local e1, e2 = vm:read_from_map(p1, p2)
	local area = VoxelArea:new({MinEdge = e1, MaxEdge = e2})
	local data = vm:get_data()
	local p2data = vm:get_param2_data()
	local cid = minetest.get_content_id(name)
	for z = p1.z, p2.z do
		for y = p1.y, p2.y do
			local vi = area:index(p1.x, y, z)
			for _ = p1.x, p2.x do
				data[vi] = cid
				p2data[vi] = 0
				vi = vi + 1
			end
		end
	end
	vm:set_data(data)
	vm:set_param2_data(p2data)
	vm:write_to_map(true)
end

local function clear_objects(center, radius)
	for _, obj in ipairs(minetest.get_objects_inside_radius(center, radius)) do
		if not obj:is_player() then obj:remove() end
	end
end

local ops = {}

ops.clear_inventory = function(player)
	local inv = player:get_inventory()
	for _, list in ipairs({"main", "craft", "craftpreview", "craftresult"}) do
		if inv:get_size(list) > 0 then inv:set_list(list, {}) end
	end
end

-- sfinv keeps the page each player's inventory was left on: a click on the "Recipes" tab in one episode
-- would open the next episode's inventory on the recipe guide instead of the crafting grid. Without
-- ``page`` this goes to the home page (crafting), which every reset does.
ops.set_gui_page = function(player, op)
	if sfinv and sfinv.set_page then sfinv.set_page(player, op.page or sfinv.get_homepage_name(player)) end
end

ops.give = function(player, op)
	local left = player:get_inventory():add_item("main", ItemStack(op.item .. " " .. (op.count or 1)))
	if not left:is_empty() then table.insert(errors, "give: no room for " .. left:to_string()) end
end

ops.set_slot = function(player, op)
	player:get_inventory():set_stack("main", op.slot, ItemStack(op.item .. " " .. (op.count or 1)))
end

ops.set_pos = function(player, op) player:set_pos(vec(op.pos)) end

-- yaw/pitch in degrees with MineStudio's signs: yaw grows turning right, pitch grows looking down.
ops.set_look = function(player, op)
	player:set_look_horizontal(math.rad(-(op.yaw or 0)) % (2 * math.pi))
	player:set_look_vertical(math.rad(op.pitch or 0))
end

ops.time = function(_, op) minetest.set_timeofday(op.value) end
ops.set_hp = function(player, op) player:set_hp(op.value) end
ops.set_breath = function(player, op) player:set_breath(op.value) end
ops.set_node = function(_, op)
	local p = vec(op.pos)
	minetest.remove_node(p)
	minetest.set_node(p, {name = op.name, param2 = op.param2 or 0})
end
ops.fill = function(_, op) fill(vec(op.pos1), vec(op.pos2), op.name) end
ops.clear_objects = function(_, op) clear_objects(vec(op.center), op.radius) end
ops.reset_events = function() reset_events() end
ops.watch = function(_, op)
	watch_names = op.names or {}
	watch_radius = op.radius or 8
	watch_min_y = op.min_y
	watch_bound = op.bound
	nearby = {}
end

-- emerge blocks the command list until the area is generated and loaded.
ops.emerge = function(_, op, job)
	local p1, p2 = sorted_box(vec(op.pos1), vec(op.pos2))
	job.waiting = true
	minetest.emerge_area(p1, p2, function(_, _, remaining)
		if remaining == 0 then job.waiting = false end
	end)
end

local function read_command()
	local f = io.open(CMD, "r")
	if not f then return end
	local text = f:read("*a")
	f:close()
	os.remove(CMD)
	local cmd = minetest.parse_json(text)
	if type(cmd) ~= "table" or type(cmd.ops) ~= "table" then
		table.insert(errors, "bad command file: " .. text:sub(1, 200))
		return
	end
	pending = {id = cmd.id, ops = cmd.ops, i = 1, waiting = false}
	errors = {}
end

local function run_pending(player)
	if not pending or pending.waiting or not player then return end
	while pending.i <= #pending.ops do
		local op = pending.ops[pending.i]
		pending.i = pending.i + 1
		local fn = ops[op.op]
		if not fn then
			table.insert(errors, "unknown op " .. tostring(op.op))
		else
			local ok, err = pcall(fn, player, op, pending)
			if not ok then table.insert(errors, tostring(op.op) .. ": " .. tostring(err)) end
		end
		if pending.waiting then return end
	end
	acked_cmd = pending.id
	pending = nil
end

-- State -----------------------------------------------------------------------------------------------

local function list_of(inv, name)
	local names, counts = {}, {}
	for i, st in ipairs(inv:get_list(name) or {}) do
		names[i] = st:get_name()
		counts[i] = st:get_count()
	end
	return {names = names, counts = counts}
end

-- The nearest few nodes of each watched kind (nearest first), so one common kind cannot crowd out the rest.
local function update_nearby(pos)
	nearby = {}
	local r = watch_radius
	local lo, hi = vector.subtract(pos, r), vector.add(pos, r)
	if watch_min_y and lo.y < watch_min_y then lo.y = watch_min_y end
	if watch_bound then
		lo.x, lo.z = math.max(lo.x, -watch_bound), math.max(lo.z, -watch_bound)
		hi.x, hi.z = math.min(hi.x, watch_bound), math.min(hi.z, watch_bound)
		if lo.x > hi.x or lo.z > hi.z then return end
	end
	for _, name in ipairs(watch_names) do
		local found = minetest.find_nodes_in_area(lo, hi, {name})
		table.sort(found, function(a, b) return vector.distance(a, pos) < vector.distance(b, pos) end)
		for i = 1, math.min(#found, 24) do
			local p = found[i]
			table.insert(nearby, {name = name, pos = {p.x, p.y, p.z}})
		end
	end
end

minetest.register_globalstep(function(dtime)
	tick = tick + 1
	local player = the_player()
	if not pending then read_command() end
	run_pending(player)
	if not player then return end
	local pos = player:get_pos()
	if tick % 4 == 0 then update_nearby(vector.round(pos)) end
	local inv = player:get_inventory()
	local state = {
		tick = tick,
		time = minetest.get_gametime(),
		timeofday = minetest.get_timeofday(),
		dtime = dtime,
		pos = {pos.x, pos.y, pos.z},
		yaw = (-math.deg(player:get_look_horizontal()) + 180) % 360 - 180,
		pitch = math.deg(player:get_look_vertical()),
		hp = player:get_hp(),
		breath = player:get_breath(),
		wield_index = player:get_wield_index(),
		gui_page = sfinv and sfinv.get_page and sfinv.get_page(player) or "",
		main = list_of(inv, "main"),
		craft = list_of(inv, "craft"),
		events = events,
		gui_quits = gui_quits,
		last_formname = last_formname,
		acked_cmd = acked_cmd,
		busy = pending ~= nil,
		nearby = nearby,
		errors = errors,
	}
	local json = minetest.write_json(state)
	if not json then return end
	local f = io.open(STATE_TMP, "w")
	if not f then return end
	f:write(json)
	f:close()
	os.rename(STATE_TMP, STATE)
end)
