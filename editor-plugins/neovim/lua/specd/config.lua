--- specd.nvim configuration: defaults, merging and validation.

local M = {}

---@class specd.Keymaps
---Insert-mode keys, set buffer-locally where specd is attached. "" leaves a key unmapped.
---@field accept string Accept the whole suggestion (falls through to the key itself when none is shown)
---@field accept_word string Accept the suggestion's next word
---@field accept_line string Accept the suggestion's next line
---@field next string Show the next alternative
---@field prev string Show the previous alternative
---@field dismiss string Hide the suggestion

---@class specd.Config
---@field enabled boolean Start with suggestions on (`:SpecdToggle` flips it)
---@field cmd string[] The language server command: specd-lsp on PATH, or a full path
---@field filetypes? string[] Filetypes to attach to; nil: every filetype
---@field root_markers string[] Files that mark a project root (one specd-lsp per root; cwd otherwise)
---@field settings table<string, any> specd-lsp settings, sent once as init_options (see docs/lsp.md)
---@field renderer 'auto'|'native'|'plugin' Ghost text by Neovim 0.12's vim.lsp.inline_completion ('native') or by this plugin ('plugin'); 'auto' picks native where available
---@field debounce_ms integer Typing pause before asking; 0: ask at each keystroke and let specd-lsp's debounce (`debounceMs`, after its type-through cache) decide. The native renderer too, where it can take Neovim's requests over (else Neovim's 200 ms pause)
---@field keymaps specd.Keymaps
---@field health_timeout_ms integer Longest `:checkhealth specd` waits for an answer

---@class specd.Options What setup() takes: any subset of specd.Config.
---@field enabled? boolean
---@field cmd? string[]
---@field filetypes? string[]
---@field root_markers? string[]
---@field settings? table<string, any>
---@field renderer? 'auto'|'native'|'plugin'
---@field debounce_ms? integer
---@field keymaps? { accept?: string, accept_word?: string, accept_line?: string, next?: string, prev?: string, dismiss?: string }
---@field health_timeout_ms? integer

---@type specd.Config
M.defaults = {
  enabled = true,
  cmd = { 'specd-lsp' },
  filetypes = nil,
  root_markers = { '.git' },
  settings = {},
  renderer = 'auto',
  debounce_ms = 0,
  keymaps = {
    accept = '<Tab>',
    accept_word = '<M-w>',
    accept_line = '<M-l>',
    next = '<M-]>',
    prev = '<M-[>',
    dismiss = '<C-]>',
  },
  health_timeout_ms = 5000,
}

-- Lists replace the default instead of merging into it index by index.
local LISTS = { 'cmd', 'filetypes', 'root_markers' }
local RENDERERS = { auto = true, native = true, plugin = true }

--- vim.validate across versions: the (name, value, type, optional) form is 0.11+.
---@param name string
---@param value any
---@param validator string|string[]|fun(v: any): boolean
---@param optional? boolean
---@param message? string
function M.validate(name, value, validator, optional, message)
  if vim.fn.has('nvim-0.11') == 1 then
    vim.validate(name, value, validator, optional, message)
  elseif not (optional and value == nil) then -- 0.10's table form: a function takes a message, not `optional`
    vim.validate({ [name] = { value, validator, type(validator) == 'function' and message or nil } })
  end
end

local function list_of_strings(value)
  if not vim.islist(value) then
    return false
  end
  for _, item in ipairs(value) do
    if type(item) ~= 'string' then
      return false
    end
  end
  return true
end

--- The user's options over the defaults, validated.
---@param opts? specd.Options
---@return specd.Config
function M.resolve(opts)
  M.validate('opts', opts, 'table', true)
  opts = opts or {}
  local config = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts) --[[@as specd.Config]]
  for _, name in ipairs(LISTS) do
    if opts[name] ~= nil then
      config[name] = opts[name]
    end
  end

  M.validate('enabled', config.enabled, 'boolean')
  M.validate('cmd', config.cmd, function(v)
    return list_of_strings(v) and #v > 0
  end, false, 'a non-empty list of strings')
  M.validate('filetypes', config.filetypes, list_of_strings, true, 'a list of filetypes')
  M.validate('root_markers', config.root_markers, list_of_strings, false, 'a list of file names')
  M.validate('settings', config.settings, 'table')
  M.validate('renderer', config.renderer, function(v)
    return RENDERERS[v] ~= nil
  end, false, "'auto', 'native' or 'plugin'")
  M.validate('debounce_ms', config.debounce_ms, 'number')
  M.validate('health_timeout_ms', config.health_timeout_ms, 'number')
  M.validate('keymaps', config.keymaps, 'table')
  for action in pairs(M.defaults.keymaps) do
    M.validate('keymaps.' .. action, config.keymaps[action], 'string')
  end
  for action in pairs(config.keymaps) do
    if M.defaults.keymaps[action] == nil then
      error(('specd: unknown keymap %q (known: %s)'):format(action, table.concat(vim.tbl_keys(M.defaults.keymaps), ', ')))
    end
  end
  return config
end

--- init_options as JSON wants them: an empty table must go out as {} (an object), not [].
--- A renderer that already waits for a typing pause of its own before it asks (Neovim's inline
--- completion, 200 ms, where specd.native cannot take its requests over) would gain nothing from
--- specd-lsp's debounce, which only drops a request that a newer one follows within
--- `debounceMs`, and would only add its 75 ms: there it is 0 unless the user set it.
---@param settings table
---@param own_pause? boolean the renderer waits for its own typing pause
---@return table
function M.init_options(settings, own_pause)
  if own_pause and settings.debounceMs == nil then
    settings = vim.tbl_extend('force', settings, { debounceMs = 0 })
  end
  return next(settings) == nil and vim.empty_dict() or settings
end

return M
