--- Ghost-text highlights that stand apart from code with or without 'termguicolors'.
---
--- The default colour scheme gives Comment and ComplHint GUI colours only, so in a terminal
--- without 'termguicolors' ghost text looked like code. SpecdGhost takes Comment's colours and
--- adds a grey, italic cterm fallback; ComplHint (0.12's own renderer) gets the same cterm
--- fallback when it has none. A user's own SpecdGhost definition wins (`default = true`).

local M = {}

local CTERM_GREY = 8 -- "bright black": grey in 16-colour and 256-colour terminals alike

---@param name string
---@return table
local function resolved(name)
  local ok, hl = pcall(vim.api.nvim_get_hl, 0, { name = name, link = false })
  return ok and hl or {}
end

---@param hl table
---@return boolean
local function has_cterm(hl)
  return hl.ctermfg ~= nil or (type(hl.cterm) == 'table' and next(hl.cterm) ~= nil)
end

function M.define()
  local comment = resolved('Comment')
  vim.api.nvim_set_hl(0, 'SpecdGhost', {
    default = true,
    fg = comment.fg,
    ctermfg = comment.ctermfg or CTERM_GREY,
    italic = true,
    cterm = { italic = true },
  })
  vim.api.nvim_set_hl(0, 'SpecdGhostHint', { link = 'NonText', default = true })
  local hint = resolved('ComplHint')
  if next(hint) ~= nil and not has_cterm(hint) then
    vim.api.nvim_set_hl(0, 'ComplHint', vim.tbl_extend('force', hint, { ctermfg = CTERM_GREY, cterm = { italic = true } }))
  end
end

--- Defines the highlights now and again after each :colorscheme (which clears them).
---@param group integer
function M.setup(group)
  M.define()
  vim.api.nvim_create_autocmd('ColorScheme', { group = group, callback = M.define })
end

return M
