--- Insert-mode keys, buffer-local where specd is attached.

local M = {}

---@type table<integer, string[]> lhs mapped per buffer
local mapped = {}

-- Actions that act only when a suggestion is shown, and otherwise type their key as before.
local FALLTHROUGH = { accept = true, accept_word = true, accept_line = true, dismiss = true }

---@param bufnr integer
function M.unmap(bufnr)
  for _, lhs in ipairs(mapped[bufnr] or {}) do
    pcall(vim.keymap.del, 'i', lhs, { buffer = bufnr })
  end
  mapped[bufnr] = nil
end

--- Maps `keymaps` (action -> lhs) in `bufnr` to `actions` (action -> function(bufnr); the
--- fall-through ones return whether a suggestion was shown).
---@param bufnr integer
---@param keymaps specd.Keymaps
---@param actions table<string, fun(bufnr: integer): boolean?>
function M.map(bufnr, keymaps, actions)
  M.unmap(bufnr)
  local lhs_list = {}
  for action, lhs in pairs(keymaps) do
    if lhs ~= '' then
      local desc = 'specd: ' .. action:gsub('_', ' ')
      local run = actions[action]
      if FALLTHROUGH[action] then
        vim.keymap.set('i', lhs, function()
          return run(bufnr) and '' or lhs
        end, { buffer = bufnr, expr = true, desc = desc })
      else
        vim.keymap.set('i', lhs, function()
          run(bufnr)
        end, { buffer = bufnr, desc = desc })
      end
      lhs_list[#lhs_list + 1] = lhs
    end
  end
  mapped[bufnr] = lhs_list
end

return M
