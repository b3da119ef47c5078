gameid = minetest
backend = sqlite3
player_backend = sqlite3
auth_backend = sqlite3
enable_damage = true
creative_mode = false
mod_storage_backend = sqlite3
