--- specd.nvim: inline completions from the specd daemon through its language server, specd-lsp.
---
--- require('specd').setup({...}) registers specd-lsp (vim.lsp.config + vim.lsp.enable on 0.11+,
--- vim.lsp.start on 0.10), shows suggestions with vim.lsp.inline_completion on 0.12+ or with this
--- plugin's ghost text before, and maps the accept/next/dismiss keys where specd is attached.

local config_mod = require('specd.config')
local status = require('specd.status')
local util = require('specd.util')

local M = {}

local MIN_VERSION = 'nvim-0.10'
local HAS_LSP_CONFIG = vim.fn.has('nvim-0.11') == 1
local STOP_TIMEOUT_MS = 5000
local RENDERERS = { native = 'specd.native', plugin = 'specd.ghost' }

local state = {
  ---@type specd.Config?
  config = nil,
  ---@type 'native'|'plugin'|nil
  renderer_name = nil,
  ---@type table? the renderer module, specd.native or specd.ghost (same functions)
  renderer = nil,
  enabled = true,
  ---@type table<integer, string[]>
  mapped = {},
}

---@param bufnr integer
---@param markers string[]
---@return string
local function root_for(bufnr, markers)
  return vim.fs.root(bufnr, markers) or vim.fn.getcwd()
end

--- The LSP client configuration for specd-lsp.
---@param config specd.Config
---@return table
local function server_config(config)
  local server = {
    cmd = config.cmd,
    filetypes = config.filetypes,
    init_options = config_mod.init_options(config.settings),
    handlers = { [status.METHOD] = status.on_notification },
  }
  if state.renderer_name == 'plugin' then
    -- This plugin implements the client side of inline completion, so say so: specd-lsp then
    -- leaves out its textDocument/completion fallback.
    server.capabilities = vim.tbl_deep_extend('force', vim.lsp.protocol.make_client_capabilities(), {
      textDocument = { inlineCompletion = { dynamicRegistration = false } },
    })
  end
  return server
end

---@param config specd.Config
---@param bufnr integer
local function start_010(config, bufnr)
  local ft = vim.bo[bufnr].filetype
  if vim.bo[bufnr].buftype ~= '' or ft == '' or (config.filetypes and not vim.tbl_contains(config.filetypes, ft)) then
    return
  end
  local server = server_config(config)
  server.name = util.NAME
  server.root_dir = root_for(bufnr, config.root_markers)
  vim.lsp.start(server, { bufnr = bufnr })
end

---@param config specd.Config
---@param group integer
local function register_server(config, group)
  if HAS_LSP_CONFIG then
    local server = server_config(config)
    server.root_dir = function(bufnr, on_dir)
      on_dir(root_for(bufnr, config.root_markers))
    end
    vim.lsp.config[util.NAME] = server -- assignment replaces an earlier setup()'s config
    vim.lsp.enable(util.NAME)
    return
  end
  vim.api.nvim_create_autocmd('FileType', {
    group = group,
    callback = function(args)
      start_010(config, args.buf)
    end,
  })
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) then
      start_010(config, bufnr)
    end
  end
end

---@param bufnr integer
local function unmap(bufnr)
  for _, lhs in ipairs(state.mapped[bufnr] or {}) do
    pcall(vim.keymap.del, 'i', lhs, { buffer = bufnr })
  end
  state.mapped[bufnr] = nil
end

-- Keys that act only when a suggestion is shown, and otherwise do what they did before.
local FALLTHROUGH = {
  accept = function(bufnr)
    return M.accept(bufnr)
  end,
  accept_word = function(bufnr)
    return M.accept_word(bufnr)
  end,
  accept_line = function(bufnr)
    return M.accept_line(bufnr)
  end,
  dismiss = function(bufnr)
    return M.dismiss(bufnr)
  end,
}

---@param bufnr integer
local function map(bufnr)
  unmap(bufnr)
  local mapped = {}
  for action, lhs in pairs(state.config.keymaps) do
    if lhs ~= '' then
      local desc = 'specd: ' .. action:gsub('_', ' ')
      if FALLTHROUGH[action] then
        vim.keymap.set('i', lhs, function()
          return FALLTHROUGH[action](bufnr) and '' or lhs
        end, { buffer = bufnr, expr = true, desc = desc })
      else
        local count = action == 'next' and 1 or -1
        vim.keymap.set('i', lhs, function()
          M.select(count, bufnr)
        end, { buffer = bufnr, desc = desc })
      end
      mapped[#mapped + 1] = lhs
    end
  end
  state.mapped[bufnr] = mapped
end

---@param client vim.lsp.Client
---@param bufnr integer
local function on_attach(client, bufnr)
  state.renderer.attach(client, bufnr, state.enabled)
  map(bufnr)
  -- specd-lsp notifies status changes at most twice a second; asking when insert mode ends keeps
  -- the statusline's latency current without a request per suggestion.
  vim.api.nvim_create_autocmd('InsertLeave', {
    group = vim.api.nvim_create_augroup('specd.buffer.' .. bufnr, { clear = true }),
    buffer = bufnr,
    callback = function()
      if not util.is_stopped(client) then
        util.request(client, status.METHOD, vim.empty_dict(), function(_, result, ctx)
          status.on_notification(nil, result, ctx)
        end, bufnr)
      end
    end,
  })
end

local function each_attached(fn)
  for _, client in ipairs(util.clients()) do
    for bufnr in pairs(client.attached_buffers) do
      fn(client, bufnr)
    end
  end
end

--- Configures specd; safe to call again (later calls replace earlier options).
---@param opts? specd.Options
function M.setup(opts)
  if vim.fn.has(MIN_VERSION) == 0 then
    vim.notify('specd.nvim needs Neovim 0.10 or newer', vim.log.levels.ERROR)
    return
  end
  local config = config_mod.resolve(opts)
  local renderer_name = config_mod.renderer(config.renderer)
  if state.renderer and state.renderer_name ~= renderer_name then
    each_attached(function(_, bufnr)
      state.renderer.detach(bufnr)
    end)
  end
  state.config, state.enabled = config, config.enabled
  state.renderer_name, state.renderer = renderer_name, require(RENDERERS[renderer_name])
  require('specd.ghost').debounce_ms = config.debounce_ms

  vim.api.nvim_set_hl(0, 'SpecdGhost', { link = 'Comment', default = true })
  vim.api.nvim_set_hl(0, 'SpecdGhostHint', { link = 'NonText', default = true })

  local group = vim.api.nvim_create_augroup('specd', { clear = true })
  vim.api.nvim_create_autocmd('LspAttach', {
    group = group,
    callback = function(args)
      local client = vim.lsp.get_client_by_id(args.data.client_id)
      if client and client.name == util.NAME then
        on_attach(client, args.buf)
      end
    end,
  })
  vim.api.nvim_create_autocmd('LspDetach', {
    group = group,
    callback = function(args)
      local client = vim.lsp.get_client_by_id(args.data.client_id)
      if client and client.name == util.NAME then
        state.renderer.detach(args.buf)
        unmap(args.buf)
        pcall(vim.api.nvim_del_augroup_by_name, 'specd.buffer.' .. args.buf)
        status.forget(client.id)
      end
    end,
  })
  register_server(config, group)
  each_attached(on_attach) -- buffers attached before this (repeated) setup()
end

---@return specd.Config? config the options in force, nil before setup()
function M.config()
  return state.config
end

---@return 'native'|'plugin'|nil
function M.renderer()
  return state.renderer_name
end

---@param bufnr? integer
---@return integer
local function buf(bufnr)
  return (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
end

---@param bufnr? integer
---@return boolean
function M.visible(bufnr)
  return state.renderer ~= nil and state.renderer.visible(buf(bufnr))
end

--- Accepts the shown suggestion. Returns false when none is shown.
---@param bufnr? integer
---@return boolean
function M.accept(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'all')
end

--- Accepts the next line of the shown suggestion.
---@param bufnr? integer
---@return boolean
function M.accept_line(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'line')
end

--- Accepts the next word of the shown suggestion.
---@param bufnr? integer
---@return boolean
function M.accept_word(bufnr)
  return state.renderer ~= nil and state.renderer.accept(buf(bufnr), 'word')
end

--- Shows the alternative `count` places on (negative: back).
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

--- :SpecdStatus: asks specd-lsp for its status and shows it.
function M.show_status()
  local client = util.clients(buf())[1] or util.clients()[1]
  if not client then
    vim.notify('specd: specd-lsp is not attached (was setup() called, is the filetype covered?)', vim.log.levels.WARN)
    return
  end
  util.request(client, status.METHOD, vim.empty_dict(), function(err, result)
    if err or type(result) ~= 'table' then
      vim.notify('specd: status failed: ' .. (err and err.message or 'no answer'), vim.log.levels.ERROR)
      return
    end
    vim.notify(table.concat(status.report(result, state.enabled), '\n'))
  end)
end

--- Stops the specd-lsp clients and starts them again for the buffers they served.
function M.restart()
  local clients = util.clients()
  local buffers = {}
  for _, client in ipairs(clients) do
    vim.list_extend(buffers, vim.tbl_keys(client.attached_buffers))
    util.stop(client)
  end
  vim.wait(STOP_TIMEOUT_MS, function()
    return vim.iter(clients):all(util.is_stopped)
  end, 20)
  if HAS_LSP_CONFIG then
    vim.lsp.enable(util.NAME) -- re-runs the enable check on every buffer
  elseif state.config then
    for _, bufnr in ipairs(buffers) do
      start_010(state.config, bufnr)
    end
  end
end

M.actions = {
  status = M.show_status,
  toggle = M.toggle,
  enable = function()
    M.set_enabled(true)
  end,
  disable = function()
    M.set_enabled(false)
  end,
  restart = M.restart,
  log = function()
    vim.cmd.tabnew(vim.lsp.get_log_path())
  end,
  health = function()
    vim.cmd.checkhealth('specd')
  end,
}

--- :Specd <action>
---@param args string[]
function M.command(args)
  local action = M.actions[args[1] or 'status']
  if not action then
    vim.notify(('specd: unknown action %q (%s)'):format(args[1], table.concat(vim.tbl_keys(M.actions), ', ')), vim.log.levels.ERROR)
    return
  end
  action()
end

return M
