--- Which renderer draws suggestions, and why: Neovim 0.12's vim.lsp.inline_completion ('native')
--- or this plugin's own ghost text ('plugin', specd.ghost). Both have the same functions.

local M = {}

local MODULES = { native = 'specd.native', plugin = 'specd.ghost' }

---@alias specd.NativeSupport 'ok'|'all-buffers'|'unknown'|'unavailable'

---@type specd.NativeSupport?
local probed

--- What this Neovim's vim.lsp.inline_completion can do (probed once).
---@return specd.NativeSupport
function M.native_support()
  if not probed then
    if vim.fn.has('nvim-0.12') == 0 or vim.lsp.inline_completion == nil then
      probed = 'unavailable'
    else
      probed = require('specd.native').probe()
    end
  end
  return probed
end

local ALL_BUFFERS = "this build's vim.lsp.inline_completion asks for every attached buffer on each keystroke"
  .. " with the current window's cursor"

--- The renderer for the `renderer` option, with a one-line reason (shown by :checkhealth specd).
---@param requested 'auto'|'native'|'plugin'
---@return 'native'|'plugin' name, string reason
function M.choose(requested)
  if requested == 'plugin' then
    return 'plugin', "renderer = 'plugin'"
  end
  local support = M.native_support()
  if support == 'unavailable' then
    if requested == 'native' then
      vim.notify('specd: vim.lsp.inline_completion needs Neovim 0.12; using the plugin renderer', vim.log.levels.WARN)
    end
    return 'plugin', 'vim.lsp.inline_completion needs Neovim 0.12'
  end
  if support == 'all-buffers' then
    if requested == 'native' then
      return 'native', "renderer = 'native'; " .. ALL_BUFFERS .. ', so specd.nvim makes its triggers buffer-local'
    end
    return 'plugin', ALL_BUFFERS .. ", so 'auto' draws suggestions with specd.nvim's own renderer"
  end
  return 'native', requested == 'native' and "renderer = 'native'" or 'vim.lsp.inline_completion (Neovim 0.12+)'
end

---@param name 'native'|'plugin'
---@return table renderer specd.native or specd.ghost
function M.module(name)
  return require(MODULES[name])
end

return M
