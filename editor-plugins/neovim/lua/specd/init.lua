--- specd.nvim: inline completions from the specd daemon through its language server, specd-lsp.
---
--- require('specd').setup({...}) registers specd-lsp (specd.server), picks the renderer
--- (specd.renderer: Neovim 0.12's vim.lsp.inline_completion or specd.ghost), maps the keys
--- (specd.keymaps) where specd attaches (specd.autocmds). This module holds the session's state
--- and the public API.

local autocmds = require('specd.autocmds')
local config_mod = require('specd.config')
local keymaps = require('specd.keymaps')
local renderers = require('specd.renderer')
local server = require('specd.server')
local status = require('specd.status')
local util = require('specd.util')

local M = {}

local state = {
  ---@type specd.Config?
  config = nil,
  ---@type 'native'|'plugin'|nil
  renderer_name = nil,
  renderer_reason = nil, ---@type string?
  renderer = nil, ---@type table? specd.native or specd.ghost (same functions)
  enabled = true,
}

---@param bufnr? integer
---@return integer
local function buf(bufnr)
  return (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
end

local function each_attached(fn)
  for _, client in ipairs(util.clients()) do
    for bufnr in pairs(client.attached_buffers) do
      fn(client, bufnr)
    end
  end
end

-- What the keymaps run: accept/dismiss return whether a suggestion was shown.
local ACTIONS = {
  accept = function(bufnr) return M.accept(bufnr) end,
  accept_word = function(bufnr) return M.accept_word(bufnr) end,
  accept_line = function(bufnr) return M.accept_line(bufnr) end,
  dismiss = function(bufnr) return M.dismiss(bufnr) end,
  next = function(bufnr) M.select(1, bufnr) end,
  prev = function(bufnr) M.select(-1, bufnr) end,
}

---@param client vim.lsp.Client
---@param bufnr integer
local function on_attach(client, bufnr)
  state.renderer.attach(client, bufnr, state.enabled)
  keymaps.map(bufnr, state.config.keymaps, ACTIONS)
  autocmds.watch_buffer(client, bufnr)
end

---@param client vim.lsp.Client
---@param bufnr integer
local function on_detach(client, bufnr)
  state.renderer.detach(bufnr)
  keymaps.unmap(bufnr)
  autocmds.forget_buffer(bufnr)
  -- The client's status goes with its last buffer: another buffer still attached keeps showing it.
  for other in pairs(client.attached_buffers or {}) do
    if other ~= bufnr then
      return
    end
  end
  status.forget(client.id)
end

--- Configures specd; safe to call again (later calls replace earlier options).
---@param opts? specd.Options
function M.setup(opts)
  if vim.fn.has('nvim-0.10') == 0 then
    vim.notify('specd.nvim needs Neovim 0.10 or newer', vim.log.levels.ERROR)
    return
  end
  local config = config_mod.resolve(opts)
  local name, reason = renderers.choose(config.renderer)
  if state.renderer and state.renderer_name ~= name then
    each_attached(function(_, bufnr)
      state.renderer.detach(bufnr)
    end)
  end
  state.config, state.enabled = config, config.enabled
  state.renderer_name, state.renderer_reason, state.renderer = name, reason, renderers.module(name)
  state.renderer.setup(config)

  local group = vim.api.nvim_create_augroup('specd', { clear = true })
  require('specd.highlights').setup(group)
  autocmds.setup(group, on_attach, on_detach)
  server.register(config, name, group)
  each_attached(on_attach) -- buffers attached before this (repeated) setup()
end

---@return specd.Config? config the options in force, nil before setup()
function M.config()
  return state.config
end

---@return 'native'|'plugin'|nil name, string? reason why this renderer
function M.renderer()
  return state.renderer_name, state.renderer_reason
end

---@param bufnr? integer
---@return boolean
function M.visible(bufnr)
  return state.renderer ~= nil and state.renderer.visible(buf(bufnr))
end

--- Accepts the shown suggestion (all of it, its next line, its next word). Each returns false
--- when none is shown.
---@param bufnr? integer
---@return boolean
function M.accept(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'all')
end

---@param bufnr? integer
---@return boolean
function M.accept_line(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'line')
end

---@param bufnr? integer
---@return boolean
function M.accept_word(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'word')
end

--- Shows the alternative `count` places on (negative: back); asks for alternatives first when
--- only one suggestion came.
---@param count integer
---@param bufnr? integer
function M.select(count, bufnr)
  if state.renderer then
    state.renderer.select(buf(bufnr), count)
  end
end

---@param bufnr? integer
function M.next(bufnr)
  M.select(1, bufnr)
end

---@param bufnr? integer
function M.prev(bufnr)
  M.select(-1, bufnr)
end

---@param bufnr? integer
---@return boolean whether a suggestion was shown
function M.dismiss(bufnr)
  return state.renderer ~= nil and state.renderer.dismiss(buf(bufnr))
end

---@return boolean
function M.is_enabled()
  return state.enabled
end

---@param enabled boolean
function M.set_enabled(enabled)
  state.enabled = enabled
  if state.renderer then
    each_attached(function(_, bufnr)
      state.renderer.set_enabled(bufnr, enabled)
    end)
  end
  vim.cmd.redrawstatus({ bang = true })
end

function M.toggle()
  M.set_enabled(not state.enabled)
  vim.notify('specd: suggestions ' .. (state.enabled and 'on' or 'off'))
end

--- The last status specd-lsp sent for this buffer's client (or any specd client).
---@param bufnr? integer
---@return specd.Status?
function M.status(bufnr)
  local client = util.clients(buf(bufnr))[1] or util.clients()[1]
  return client and status.get(client.id)
end

--- Statusline component: "" where specd is not attached, else e.g. "specd 42ms 78%".
---@param bufnr? integer
---@return string
function M.statusline(bufnr)
  local client = util.clients(buf(bufnr))[1]
  if not client then
    return ''
  end
  return status.format(status.get(client.id), state.enabled)
end

--- Stops the specd-lsp clients and starts them again for the buffers they served.
function M.restart()
  server.restart(state.config, state.renderer_name)
end

--- :SpecdStatus: asks specd-lsp for its status and shows it.
function M.show_status()
  require('specd.commands').show_status(state.enabled)
end

--- :Specd <action>
---@param args string[]
function M.command(args)
  require('specd.commands').run(args)
end

return M
