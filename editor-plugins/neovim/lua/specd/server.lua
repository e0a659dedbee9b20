--- specd-lsp's registration: vim.lsp.config + vim.lsp.enable on 0.11+, vim.lsp.start per buffer
--- (from a FileType autocommand) on 0.10.

local status = require('specd.status')
local util = require('specd.util')

local M = {}

M.HAS_LSP_CONFIG = vim.fn.has('nvim-0.11') == 1

local STOP_TIMEOUT_MS = 5000

---@param bufnr integer
---@param markers string[]
---@return string
local function root_for(bufnr, markers)
  return vim.fs.root(bufnr, markers) or vim.fn.getcwd()
end

--- The LSP client configuration for specd-lsp.
---@param config specd.Config
---@param renderer_name 'native'|'plugin'
---@return table
local function client_config(config, renderer_name)
  local server = {
    cmd = config.cmd,
    filetypes = config.filetypes,
    init_options = require('specd.config').init_options(config.settings,
      renderer_name == 'native' and not require('specd.native').can_take_over()),
    handlers = {
      [status.METHOD] = status.on_notification,
      [require('specd.grew').METHOD] = require('specd.grew').handler(renderer_name),
    },
  }
  if renderer_name == 'plugin' then
    -- This plugin implements the client side of inline completion, so say so: specd-lsp then
    -- leaves out its textDocument/completion fallback.
    server.capabilities = vim.tbl_deep_extend('force', vim.lsp.protocol.make_client_capabilities(), {
      textDocument = { inlineCompletion = { dynamicRegistration = false } },
    })
  end
  return server
end

---@param config specd.Config
---@param renderer_name 'native'|'plugin'
---@param bufnr integer
local function start_010(config, renderer_name, bufnr)
  local ft = vim.bo[bufnr].filetype
  if vim.bo[bufnr].buftype ~= '' or ft == '' or (config.filetypes and not vim.tbl_contains(config.filetypes, ft)) then
    return
  end
  local server = client_config(config, renderer_name)
  server.name = util.NAME
  server.root_dir = root_for(bufnr, config.root_markers)
  vim.lsp.start(server, { bufnr = bufnr })
end

--- Registers specd-lsp so it starts for matching buffers (those open now included).
---@param config specd.Config
---@param renderer_name 'native'|'plugin'
---@param group integer the augroup for 0.10's FileType autocommand
function M.register(config, renderer_name, group)
  if M.HAS_LSP_CONFIG then
    local server = client_config(config, renderer_name)
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
      start_010(config, renderer_name, args.buf)
    end,
  })
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) then
      start_010(config, renderer_name, bufnr)
    end
  end
end

--- Stops the specd-lsp clients and starts them again for the buffers they served.
---@param config? specd.Config
---@param renderer_name? 'native'|'plugin'
function M.restart(config, renderer_name)
  local clients = util.clients()
  local buffers = {}
  for _, client in ipairs(clients) do
    vim.list_extend(buffers, vim.tbl_keys(client.attached_buffers))
    util.stop(client)
  end
  vim.wait(STOP_TIMEOUT_MS, function()
    return vim.iter(clients):all(util.is_stopped)
  end, 20)
  if M.HAS_LSP_CONFIG then
    vim.lsp.enable(util.NAME) -- re-runs the enable check on every buffer
  elseif config and renderer_name then
    for _, bufnr in ipairs(buffers) do
      start_010(config, renderer_name, bufnr)
    end
  end
end

return M
